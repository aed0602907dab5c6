"""State: checkpoint writes and reads through the strategy (temp files, optimizer state), RNG."""

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from backends import DDP, FSDP, FullPrecision, TrainerBackend
from backends.checkpoint_io.base import CheckpointIO
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_state"


class TempNeverRenamed(DDP):
    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        if not self.is_main_process:
            return lambda: None
        data = io.stage(state) if copy else state
        temporary = f"{path}.tmp"  # slip: writes the temporary file "atomically"... and never renames it
        return lambda: io.write(temporary, data)


class OptimizerNotLoaded(FSDP):
    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        return super().load_checkpoint(path, io, target)  # slip: optimizers not passed on (their state not created first)


class ReseedsByRank(DDP):
    def setup(self) -> None:
        super().setup()
        torch.manual_seed(torch.initial_seed() + self.rank)  # slip: "so dropout differs per rank": reseeds the run


fault(
    "blind-ddp-ckpt-temp-never-renamed",
    lambda args: TrainerBackend(TempNeverRenamed.from_arguments(args), FullPrecision()),
    area="state",
    slip="save_checkpoint writes <path>.tmp and never renames it to <path>: no checkpoint ever appears",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9/mlp (2), resume_signal, evaluate_checkpoints",
)
fault(
    "blind-fsdp-resume-optimizer-not-loaded",
    lambda args: TrainerBackend(OptimizerNotLoaded.from_arguments(args), FullPrecision()),
    area="state",
    slip="load_checkpoint drops the optimizers argument: sharded optimizer state (Adam moments) not restored",
    control="fsdp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9/mlp (2) (Adam in the clipping/resume cells)",
)
fault(
    "blind-ddp-setup-reseeds-by-rank",
    lambda args: TrainerBackend(ReseedsByRank.from_arguments(args), FullPrecision()),
    area="state",
    slip="setup() reseeds torch with initial_seed + rank: the RNG stream differs from the run's seed",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic/per_rank_init, meta (layers drawn after setup), anything with dropout",
)
