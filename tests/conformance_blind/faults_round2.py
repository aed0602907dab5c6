"""Round 2 of the blind faults: DDP wrapped by the plugin (comm hooks, re-arming for manual
backwards), FSDP's manual seam and sharded reads, GradScaler steps, pipeline plugins, and layouts
that only exist on 4 ranks (dp 2 x tp 2, ddp on 4 ranks).

Written from the public contract only (docs/*.md, README.md, CONTRIBUTING.md, backends/**/*.py,
framework/module.py, framework/loop/manual_optimization.py) and the round-1 faults; nothing
under framework/conformance/ was read. Each class is one slip in one overridden method of a
correct built-in, or of a correct control in :mod:`tests.conformance_blind.controls`.
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from backends import DDP, FSDP, FullPrecision, MixedPrecision, ModelParallel, SingleProcess, TrainerBackend
from backends.checkpoint_io.base import CheckpointIO, is_sharded_checkpoint
from backends.data.samplers import ResumableSampler
from backends.options import option
from backends.strategies.fsdp import _fsdp_state
from backends.strategies.pipeline_schedule import PipelineRunner
from tests.conformance_blind import fault
from tests.conformance_blind.controls import pipeline_backend

MODULE = "tests.conformance_blind.faults_round2"
PIPELINE_ONLY = ("--models", "pipeline")  # the kit ignores a plugin's conformance_shapes (see SCORE_ROUND2.md)


# -- DDP wrapped by the plugin ------------------------------------------------------------------
def _summing_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A hand-written all-reduce hook (the start of a compression hook)."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])  # slip: the sum is never divided by the world size


class SummingCommHook(DDP):
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        wrapped = super().wrap_module(module)
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.register_comm_hook(None, _summing_hook)
        return wrapped


class TorchDefaultHook(DDP):
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        wrapped = super().wrap_module(module)
        if isinstance(wrapped, DistributedDataParallel):
            # slip: torch's own all-reduce hook (the docs' counting example minus the count) replaces the strategy's
            # ready-order hook: a resumed process's first step sums in DDP's first-step bucket layout again
            wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        return wrapped


class RearmOnlyForUnused(DDP):
    def prepare_for_backward(self, wrapped: torch.nn.Module, loss: torch.Tensor) -> None:
        if not self.find_unused_parameters:  # slip: "re-arming only matters when searching for unused parameters"
            return
        super().prepare_for_backward(wrapped, loss)


class PadByRemainder(ResumableSampler):
    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_size))
        if self.pad and self.dataset_size % self.world_size:
            missing = self.dataset_size % self.world_size  # slip: the remainder, not world_size - remainder
            indices += (indices * (missing // max(len(indices), 1) + 1))[:missing]
        shard = indices[self.rank :: self.world_size]
        self._iterator, self._shard_end = iter(shard[self.skip :]), len(shard)
        return self._iterator


class PaddingByRemainder(DDP):
    def create_sampler(self, dataset: Any, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        return PadByRemainder(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=pad
        )


# -- FSDP: the manual seam and sharded reads -----------------------------------------------------
class RefreshUnshardOnly(FSDP):
    def refresh_parameters(self, wrapped: torch.nn.Module) -> None:
        if _fsdp_state(wrapped) is None:
            return
        wrapped.unshard()  # type: ignore[operator]  # slip: no reshard first: an already gathered root keeps its stale copy


class ReadWithoutAgreeing(FSDP):
    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        from backends.checkpoint_io import sharded_checkpoint

        if not is_sharded_checkpoint(path):
            return super().load_checkpoint(path, io, target, optimizers)
        # slip: each rank checks its read alone ("every rank reads its own shards"): no _agree_readable, no agree=
        return sharded_checkpoint.load(path, io, target, optimizers, distributed=self.distributed, one_stage=self.pipelined)


# -- GradScaler (bf16 autocast with dynamic loss scaling on CPU) ----------------------------------
class UpdatePerOptimizer(MixedPrecision):
    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        if self.scaler is None:
            return super().step_optimizers(optimizers, closure)
        if closure is not None:
            raise ValueError("optimizers that need a closure (e.g. LBFGS) cannot run with an fp16 GradScaler")
        scale_before = self.scaler.get_scale()
        for optimizer in optimizers:
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self.scaler.step(optimizer)
            self.scaler.update()  # slip: inside the loop: one update per optimizer, an overflow halves the scale twice
        return self.scaler.get_scale() >= scale_before


class TakenOnlyIfGrown(MixedPrecision):
    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        if self.scaler is None:
            return super().step_optimizers(optimizers, closure)
        if closure is not None:
            raise ValueError("optimizers that need a closure (e.g. LBFGS) cannot run with an fp16 GradScaler")
        scale_before = self.scaler.get_scale()
        for optimizer in optimizers:
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() > scale_before  # slip: > for >=: an unchanged scale reads as a skipped step


def scaled(precision: type) -> Callable[[Any], TrainerBackend]:
    return lambda args: TrainerBackend(
        SingleProcess.from_arguments(args), precision(dtype=option(args, "amp_dtype"), use_grad_scaler=True)
    )


# -- model-parallel on 4 ranks (dp 2 x tp 2) ------------------------------------------------------
class DataRankModulo(ModelParallel):
    @property
    def data_parallel_rank(self) -> int:  # slip: the place along dp read as rank % dp size (tp is the inner axis)
        return self.rank % self.data_parallel_size


# -- pipeline plugins (fsdp with pp 2) ------------------------------------------------------------
class PipelineReduceNoGroup(FSDP):
    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not self.pipelined or self.pipeline_mesh is None:
            return super().data_parallel_all_reduce(tensor, op)
        from backends.strategies.ddp import reduce_over

        return reduce_over(tensor, op, self.data_parallel_size)  # slip: the dp group left out: every rank, every stage


class RunnerByCount(FSDP):
    def pipeline_runner(
        self, micro_batches: int, loss: Callable[[Any, Any], torch.Tensor], inputs: Sequence[Any] = ()
    ) -> PipelineRunner:
        if self.stage_module is None:
            raise RuntimeError("pipeline_runner() before wrap_module(): the stage is cut when the module is wrapped")
        runner = self._runners.get(micro_batches)  # slip: cached by the count alone, not by the inputs' shapes too
        if runner is None:
            schedule = self.pipeline_schedule if micro_batches >= self.pipeline_parallel_size else "GPipe"
            runner = PipelineRunner(
                self.stage_module,
                self.pipeline_rank,
                self.pipeline_parallel_size,
                self.device,
                self.pipeline_group(),
                schedule,
                micro_batches,
                loss,
            )
            self._runners[micro_batches] = runner
        runner.loss = loss
        return runner


class LastStageRepresentsFirst(FSDP):
    def data_parallel_representatives(self) -> List[int]:
        if not self.pipelined:
            return super().data_parallel_representatives()
        return list(range(self.ranks_per_stage))  # slip: stage 0's ranks speak for the data, not the last stage's


# -- registration ---------------------------------------------------------------------------------
def _ddp(strategy: type) -> Callable[[Any], TrainerBackend]:
    return lambda args: TrainerBackend(strategy.from_arguments(args), FullPrecision())


fault(
    "blind2-ddp-comm-hook-sum",
    _ddp(SummingCommHook),
    area="ddp-wrap",
    slip="wrap_module registers its own all-reduce comm hook that sums the bucket and never divides by the world size",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic/mlp (2): gradients twice the mean",
)
fault(
    "blind2-ddp-default-hook-4",
    _ddp(TorchDefaultHook),
    area="ddp-wrap",
    slip="wrap_module registers torch's default allreduce_hook, replacing the ready-order hook: a resume on 4 ranks is off",
    control="ddp",
    ranks=4,
    module=MODULE,
    expect="resume_kill9/mlp (4): resumes bitwise on any number of ranks (docs/distributed.md)",
)
fault(
    "blind2-ddp-rearm-only-unused",
    _ddp(RearmOnlyForUnused),
    area="manual",
    slip="prepare_for_backward re-arms DDP's reducer only with find_unused_parameters: a forward's second backward is unsynced",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="manual (2) with two backwards through one forward (a GAN's generator and discriminator losses): ranks differ",
)
fault(
    "blind2-ddp-pad-by-remainder-4",
    _ddp(PaddingByRemainder),
    area="data",
    slip="the training sampler pads by size % world instead of world - size % world: equal at 2 ranks, uneven at 4",
    control="ddp",
    ranks=4,
    module=MODULE,
    expect="automatic/mlp (4) if the training set is not a multiple of 4 (ranks step different counts: a hang)",
)
fault(
    "blind2-fsdp-refresh-unshard-only",
    lambda args: TrainerBackend(RefreshUnshardOnly.from_arguments(args), FullPrecision()),
    area="manual",
    slip="refresh_parameters unshards without resharding first: after a manual step the root computes with stale weights",
    control="fsdp",
    ranks=2,
    module=MODULE,
    expect="manual/mlp (2) on fsdp (a forward after an optimizer step in one train_step)",
)
fault(
    "blind2-fsdp-read-without-agreeing",
    lambda args: TrainerBackend(ReadWithoutAgreeing.from_arguments(args), FullPrecision()),
    area="state",
    slip="load_checkpoint checks a sharded checkpoint on each rank alone: no _agree_readable, no agree= for the read",
    control="fsdp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9/mlp (2): a checkpoint damaged on one rank only (the other rank waits in DCP's read)",
)
fault(
    "blind2-sp-amp-scaled-update-per-optimizer",
    scaled(UpdatePerOptimizer),
    area="precision",
    slip="step_optimizers calls scaler.update() after each optimizer: with two, an overflow halves the scale twice",
    control="blind-ctl-sp-amp-scaled",
    ranks=1,
    module=MODULE,
    expect="overflow/mlp (1) if it steps two optimizers; clipping/mlp (1) (SGD + Adam) if a step overflows",
)
fault(
    "blind2-sp-amp-scaled-taken-if-grown",
    scaled(TakenOnlyIfGrown),
    area="precision",
    slip="step_optimizers reports a step taken only if the loss scale grew (> for >=): per-step schedulers stall",
    control="blind-ctl-sp-amp-scaled",
    ranks=1,
    module=MODULE,
    expect="overflow/mlp (1), probes/mlp (1) (per-step LR schedule)",
)
fault(
    "blind2-mp-dp-rank-modulo-4",
    lambda args: TrainerBackend(DataRankModulo.from_arguments(args), FullPrecision()),
    area="model-parallel",
    slip="data_parallel_rank = rank % data_parallel_size (tp is the inner axis): at dp 2 x tp 2, tp peers read other data",
    control="model-parallel",
    ranks=4,
    module=MODULE,
    expect="automatic/mlp (4), evaluate/mlp (4) on the dp 2 x tp 2 layout",
)
fault(
    "blind2-fsdp-pp-reduce-no-group",
    lambda args: pipeline_backend(args, PipelineReduceNoGroup),
    area="pipeline",
    slip="data_parallel_all_reduce under a pipeline reduces over every rank (the dp group argument left out)",
    control="blind-ctl-fsdp-pp",
    ranks=2,
    module=MODULE,
    expect="automatic/pipeline (2) or evaluation on a pipeline: metrics reduced over both stages (a sum counted twice)",
    kit_args=PIPELINE_ONLY,
)
fault(
    "blind2-fsdp-pp-runner-by-count",
    lambda args: pipeline_backend(args, RunnerByCount),
    area="pipeline",
    slip="pipeline_runner caches runners by micro-batch count alone: a short last batch reuses one built for full ones",
    control="blind-ctl-fsdp-pp",
    ranks=2,
    module=MODULE,
    expect="automatic/pipeline (2) with a short last batch (shape mismatch between stages)",
    kit_args=PIPELINE_ONLY,
)
fault(
    "blind2-fsdp-pp-first-stage-represents",
    lambda args: pipeline_backend(args, LastStageRepresentsFirst),
    area="pipeline",
    slip="data_parallel_representatives under a pipeline returns stage 0's ranks, not the last stage's (where the loss is)",
    control="blind-ctl-fsdp-pp",
    ranks=2,
    module=MODULE,
    expect="a pipeline evaluation (val_loss gathered from the representatives); none in the rows yet",
    kit_args=PIPELINE_ONLY,
)
