"""Mutants that change a run's path but not where it ends: killed only by the trajectory a cell
records (the step a resume started from, what the checkpoint directory holds, each step's values).
One fault each."""

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Sequence, Tuple

import torch

from backends import DDP, FullPrecision
from backends.checkpoint_io.base import CheckpointIO
from framework.conformance.mutants.library import Kill, backend, register_mutant


class NeverRenamed(DDP):
    """Writes each checkpoint under a temporary name it never renames into place: every resume restarts from step 0."""

    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        return super().save_checkpoint(path + ".tmp", state, io, copy)


class LocalPreemption(DDP):
    """Each rank stops at the step its own preemption signal arrived, without agreeing with the others."""

    def preemption_agreed(self, signal_pending: bool, global_step: int) -> bool:
        return signal_pending


class LocalStopReasons(DDP):
    """Each rank keeps its own stop reasons when the ranks agree to stop (``any_rank`` without its all-reduce)."""

    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        return [bool(flag) for flag in flags]


class BarrierDoesNothing(DDP):
    """``barrier()`` returns at once: rank zero reads files the other ranks have not written yet."""

    def barrier(self) -> None:
        pass


def _register(name: str, strategy: Any, kills: Tuple[Kill, ...], kind: str, precision: Any = FullPrecision) -> None:
    register_mutant(name, backend(strategy, precision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-ddp-never-renamed", NeverRenamed, (("resume_kill9", "mlp", 2),), "state")
_register("mutant-ddp-local-preemption", LocalPreemption, (("resume_signal", "mlp", 2),), "collectives")
_register("mutant-ddp-barrier-does-nothing", BarrierDoesNothing, (("evaluate", "mlp", 2),), "collectives")
_register("mutant-ddp-local-stop-reasons", LocalStopReasons, (("resume_signal", "mlp", 2),), "collectives")


class OwnBuffersInEvaluation(DDP):
    """Evaluates on each rank's own buffers (batch norm's running statistics), not rank zero's, which checkpoints keep."""

    def inference(self, module: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()


_register("mutant-ddp-own-buffers-in-evaluation", OwnBuffersInEvaluation, (("evaluate_buffers", "batchnorm", 2),), "evaluation")
