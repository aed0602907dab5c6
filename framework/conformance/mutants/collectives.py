"""Mutants of the DDP strategy that break a collective or a broadcast: one fault each."""

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Sequence, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel

from backends import DDP, FullPrecision, MixedPrecision
from backends.data.batch import map_tensors
from backends.data.samplers import interleave_ranks
from framework.conformance.mutants.library import backend, register_mutant


class NoAllReduce(DDP):
    """Joins the process group but never wraps the module: gradients are never averaged."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class NoBroadcast(DDP):
    """Averages gradients, but never broadcasts rank zero's initial parameters (``init_sync=False``)."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        return DistributedDataParallel(module, init_sync=False, broadcast_buffers=False)


class UnsyncedBuffers(DDP):
    """Broadcasts parameters, but never buffers (``broadcast_buffers=False``: not at start, not per forward)."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        return DistributedDataParallel(module, broadcast_buffers=False)


class DroppingNoSync(DDP):
    """``no_sync`` that throws away the gradients accumulated inside it."""

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        inner = super().no_sync(wrapped, skip_gradient_sync)
        return _dropping(inner, wrapped) if skip_gradient_sync else inner


@contextlib.contextmanager
def _dropping(inner: ContextManager, wrapped: torch.nn.Module) -> Iterator[None]:
    with inner:
        yield
    for parameter in wrapped.parameters():
        parameter.grad = None


class MeanReturnsOwn(DDP):
    """The mean all-reduce (logged losses, stop flags) returns this rank's own value."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor.clone() if op == "mean" else super().all_reduce(tensor, op)


class MeanIsSum(DDP):
    """The mean all-reduce sums over the ranks and forgets to divide (a wrong reduce op)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return super().all_reduce(tensor, "sum" if op == "mean" else op)


class UnreducedMetrics(DDP):
    """Logged metrics are not reduced over the data-parallel ranks: each rank keeps its own."""

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor.clone()


class GatherSwappedRanks(DDP):
    """Evaluation outputs merged as if rank 1 were rank 0 (gathered by global rank, listed in reverse), not in dataset order."""

    def gather_in_dataset_order(self, outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not self.distributed:
            return outputs
        gathered = self.all_gather_object(map_tensors(outputs, torch.Tensor.cpu))
        return interleave_ranks(list(reversed(gathered)))


class PerParameterClipping(DDP):
    """Clips each parameter's gradient by its own norm, not the total norm of all of them."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        if max_norm is None:
            return super().clip_gradients(parameters, max_norm, max_value)
        norms = [torch.nn.utils.clip_grad_norm_([p], max_norm) for p in parameters if p.grad is not None]
        return torch.stack(norms).norm() if norms else torch.tensor(0.0)


def _ddp(name: str, strategy: Any, kills: Tuple[Tuple[str, str, int], ...], kind: str, precision: Any = FullPrecision) -> None:
    register_mutant(name, backend(strategy, precision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_ddp("mutant-ddp-no-allreduce", NoAllReduce, (("automatic", "mlp", 2),), "collectives")
_ddp("mutant-ddp-no-broadcast", NoBroadcast, (("automatic", "mlp", 2),), "broadcasts")
_ddp("mutant-ddp-unsynced-buffers", UnsyncedBuffers, (("automatic", "buffers", 2),), "broadcasts")
_ddp("mutant-ddp-dropping-no-sync", DroppingNoSync, (("accumulation", "mlp", 2),), "collectives")
_ddp("mutant-ddp-mean-returns-own", MeanReturnsOwn, (("automatic", "mlp", 2),), "collectives")
_ddp("mutant-ddp-mean-is-sum", MeanIsSum, (("automatic", "mlp", 2),), "collectives")
_ddp("mutant-ddp-unreduced-metrics", UnreducedMetrics, (("evaluate", "mlp", 2),), "evaluation")
_ddp("mutant-ddp-gather-swapped-ranks", GatherSwappedRanks, (("evaluate", "mlp", 2),), "evaluation")
_ddp("mutant-ddp-per-parameter-clipping", PerParameterClipping, (("clipping", "mlp", 2),), "clipping")
_ddp("mutant-ddp-amp-per-parameter-clipping", PerParameterClipping, (("clipping", "mlp", 2),), "clipping", MixedPrecision)
