"""Mutants of the layouts only some backends can break (issue 41): a tied embedding untied by the
tensor-parallel split, ``Partial`` gradients measured once per tensor-parallel rank, rank 1's batch
norm statistics checkpointed, meta-built layers drawn without the run's seed, experts a rank did not
use left out of its reduce-scatter. One fault each; each
is killed only by the zoo shape made for it (``framework/conformance/zoo_layouts.py``, the 2-rank
``batchnorm`` resume), every other cell passes on it."""

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from backends import FSDP, FullPrecision, ModelParallel
from backends.checkpoint_io import CheckpointIO
from backends.strategies.gradient_clipping import _by_kind, _group_key, _group_power, clip_grads_with_norm_
from backends.strategies.model_parallel import custom_parallelize, tensor_parallel_plan
from framework.conformance.mutants.library import backend, register_mutant


class UntiedEmbedding(ModelParallel):
    """The tensor-parallel split gives each site of a tied weight its own DTensor: the embedding and the head train apart."""

    def split_over_tensor_parallel(self, target: torch.nn.Module, tp_mesh: Any) -> None:
        if custom_parallelize(target):
            target.parallelize(tp_mesh)  # type: ignore[operator]
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(target, tp_mesh, tensor_parallel_plan(target))  # fault: no retie() after the split


class PartialCountedPerRank(ModelParallel):
    """Clipping measures ``Partial`` gradients (sequence-parallel norms) as if sharded: each tp rank's part counted alone."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        if max_norm is None:
            return super().clip_gradients(parameters, max_norm, max_value)
        having = [parameter for parameter in parameters if parameter.grad is not None]
        groups: Dict[Any, List[torch.Tensor]] = {}
        for parameter in having:  # fault: not settled first, so a Partial dimension is summed as a Shard one
            groups.setdefault(_group_key(parameter.grad), []).append(parameter.grad)  # type: ignore[arg-type]
        total = torch.stack([_group_power(gradients, 2.0) for gradients in groups.values()]).sum().sqrt()
        for members in _by_kind(having):
            clip_grads_with_norm_(members, max_norm, total)
        return total


class SavesRankOneBuffers(FSDP):
    """A sharded save writes rank 1's buffers (batch norm's running statistics), not rank zero's."""

    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        if self._buffer_owner is not None and self.distributed:
            for buffer in self._buffer_owner.buffers():
                if not hasattr(buffer, "device_mesh"):
                    dist.broadcast(buffer.data, src=1)  # fault: rank 1's copy is the one every rank (and DCP) keeps
        return super().save_checkpoint(path, state, io, copy)


class MetaIgnoresSeed(ModelParallel):
    """Layers built on the meta device are initialized from seed 0, whatever ``TrainerArguments.seed`` is."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # fault: materialize() draws from torch.initial_seed(), now 0, not the run's seed
            return super().wrap_module(module)


def _register(name: str, strategy: Any, kills: Any, kind: str) -> None:
    register_mutant(name, backend(strategy, FullPrecision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-model-parallel-untied-embedding", UntiedEmbedding, (("automatic", "tied-tp", 2),), "state")
_register("mutant-model-parallel-partial-per-rank", PartialCountedPerRank, (("clipping", "sequence-parallel", 2),), "clipping")
_register("mutant-fsdp-saves-rank1-buffers", SavesRankOneBuffers, (("resume_kill9", "batchnorm", 2),), "state")
_register("mutant-model-parallel-meta-ignores-seed", MetaIgnoresSeed, (("automatic", "meta", 2),), "broadcasts")


class SkipsUnusedParameters(FSDP):
    """Parameters a rank did not use in a step (an expert no sample chose) get no reduce-scatter there: collectives part."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        wrapped = super().wrap_module(module)
        if self.distributed and hasattr(wrapped, "set_reduce_scatter_unused_params"):
            wrapped.set_reduce_scatter_unused_params(False)  # type: ignore[operator]  # fault: FSDP2's default, unused parameters skipped
        return wrapped


_register("mutant-fsdp-skips-unused-parameters", SkipsUnusedParameters, (("automatic", "experts", 2),), "collectives")
