"""Notes logged once when training starts: how checkpoints are kept, how the processes run."""

import logging
from typing import TYPE_CHECKING, List

from backends.environments import LocalEnvironment

if TYPE_CHECKING:  # pragma: no cover
    from framework.loop.view import TrainerView

logger = logging.getLogger("framework")


def run_start_notes(trainer: "TrainerView") -> List[str]:
    """The lines :func:`log_run_start` writes (every rank computes them; nothing collective).

    - what the checkpointer writes and keeps (``AbstractCheckpointer.describe``), unless
      checkpointing is off (``fast_dev_run``);
    - that a multi-process backend (``ddp``...) runs as one process, when it was started
      without a launcher or with a world size of 1.
    """
    notes = []
    if trainer.checkpointing_enabled:
        description = trainer.checkpointer.describe()
        if description:
            notes.append(description)
    if trainer.backend.multi_process and trainer.backend.world_size == 1:
        environment = trainer.backend.cluster_environment
        how = (
            "not launched by torchrun/srun"
            if isinstance(environment, LocalEnvironment)
            else f"{environment.launcher} started a world size of 1"
        )
        notes.append(f"{trainer.args.backend} backend with one process ({how}): training as a single process")
    return notes


def log_run_start(trainer: "TrainerView") -> None:
    """Log :func:`run_start_notes` at INFO on rank zero."""
    if trainer.is_main_process:
        for note in run_start_notes(trainer):
            logger.info("%s", note)
