"""Collectives: all-reduce, barrier, any-rank decisions, no_sync, rank-zero work (each a DDP subclass)."""

from typing import Any, Callable, ContextManager, List, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from backends import DDP, FullPrecision, TrainerBackend
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_collectives"


def on_ddp(strategy: Type[DDP]) -> Callable[[Any], TrainerBackend]:
    return lambda args: TrainerBackend(strategy.from_arguments(args), FullPrecision())


class AllReduceIgnoresOp(DDP):
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not self.distributed:
            return tensor.clone()
        result = tensor.clone()
        dist.all_reduce(result)  # slip: always SUM and divide, whatever op was asked for
        return result / self.world_size


class BarrierDoesNothing(DDP):
    def barrier(self) -> None:
        """slip: "gloo collectives already synchronise the ranks", so the barrier is skipped."""


class AnyRankIsLocal(DDP):
    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        return [bool(flag) for flag in flags]  # slip: assumes every rank sets the same flags


class NoSyncInverted(DDP):
    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        return super().no_sync(wrapped, not skip_gradient_sync)  # slip: the flag read as "sync now"


class RankZeroWorkEverywhere(DDP):
    def run_on_rank_zero(self, compute: Callable[[], Any], what: str, share_as: Tuple[type, ...] = ()) -> Any:
        return compute()  # slip: "cheaper than a broadcast": every rank does rank zero's work


fault(
    "blind-ddp-allreduce-ignores-op",
    on_ddp(AllReduceIgnoresOp),
    area="collectives",
    slip="all_reduce always sums then divides by the world size: 'sum' becomes a mean, 'max'/'min' the mean too",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="evaluate (sum-reduced metrics), automatic (logged losses agree though); early_stopping/streams",
)
fault(
    "blind-ddp-barrier-noop",
    on_ddp(BarrierDoesNothing),
    area="collectives",
    slip="barrier() does nothing: ranks race around checkpoint writes and reads",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9 / resume_signal / evaluate_checkpoints (a rank reading a checkpoint still being written)",
)
fault(
    "blind-ddp-any-rank-local",
    on_ddp(AnyRankIsLocal),
    area="collectives",
    slip="any_rank returns this rank's own flags without the max all-reduce (stop/NaN decisions not agreed)",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="nan_stop, early_stopping, resume_signal (a flag set on one rank only)",
)
fault(
    "blind-ddp-no-sync-inverted",
    on_ddp(NoSyncInverted),
    area="collectives",
    slip="no_sync reads skip_gradient_sync backwards: the last micro-batch skips the all-reduce, the others sync",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic/mlp (2), accumulation/mlp (2)",
)
fault(
    "blind-ddp-rank-zero-work-everywhere",
    on_ddp(RankZeroWorkEverywhere),
    area="collectives",
    slip="run_on_rank_zero runs compute() on every rank and broadcasts nothing (rank zero's answer not shared)",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9, evaluate_checkpoints (two ranks writing/choosing files), export_weights",
)
