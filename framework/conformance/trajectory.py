"""What a cell sees of a run besides where it ends: every value the run recorded (each step's
losses and logged metrics, learning rates and loss scale), the step a (resumed) run started from, and what its checkpoint
directory holds after each save.

A fault that changes a run's path but not its end (a resume that silently restarts from step 0
and retraces the same steps, a scheduler that advances on a skipped step, a logged norm taken
after clipping) shows here: cells compare the trajectory with the reference's, or a resumed
run's with the same backend's uninterrupted run.
"""

import os
from typing import Any, Dict, List, Optional

from framework.callbacks import Callback
from framework.callbacks.lr_monitor import learning_rates
from framework.run.lock_file import LOCK_NAME


def loss_scale(precision: Any) -> Optional[float]:
    """The precision's current loss scale (its ``scaler``, a ``torch.amp.GradScaler``), or None.

    Example:
        >>> from backends import FullPrecision
        >>> loss_scale(FullPrecision()) is None
        True
    """
    scaler = getattr(precision, "scaler", None)
    if scaler is None or not hasattr(scaler, "get_scale") or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    return float(scaler.get_scale())


def checkpoint_listing(save_dir: Optional[str], suffix: str = ".pt") -> List[str]:
    """The names in ``save_dir`` but the run lock's (hidden and temporary ones included: a write
    never renamed into place shows), with a checkpoint file's ``suffix`` removed so that a sharded checkpoint (a
    directory) and a single file list alike.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> for name in ("checkpoint-2.pt", "checkpoint-4.pt.tmp"):
        ...     open(os.path.join(directory, name), "w").close()
        >>> checkpoint_listing(directory)
        ['checkpoint-2', 'checkpoint-4.pt.tmp']
    """
    if not save_dir or not os.path.isdir(save_dir):
        return []
    names = [name for name in os.listdir(save_dir) if not name.startswith(LOCK_NAME)]  # the run lock comes and goes
    return sorted(name[: -len(suffix)] if suffix and name.endswith(suffix) else name for name in names)


class Trajectory(Callback):
    """Records a run's path: at each optimizer step it records (``trainer.log_metrics``: into the
    history, which checkpoints keep) the learning rate of every parameter group (``kit_lr...``)
    and the loss scale (``kit_loss_scale``, where the precision has a GradScaler); it keeps the
    step training started from (0, or the step a resume restored) and what ``save_dir`` holds
    before each step and at the end (each distinct listing once, in order).

    Args:
        save_dir: the run's checkpoint directory (None: no listing).

    Example:
        >>> trajectory = Trajectory()
        >>> trajectory.on_begin_train(4)
        >>> trajectory.started
        4
    """

    def __init__(self, save_dir: Optional[str] = None) -> None:
        self.save_dir = save_dir
        self.started: Optional[int] = None
        self.listings: List[List[str]] = []

    def on_begin_train(self, global_step: int) -> None:
        self.started = global_step
        self.list_checkpoints()

    def on_end_optimizer_step(self, global_step: int) -> None:
        values = learning_rates(self.trainer.optimizers, "kit_lr")
        scale = loss_scale(self.trainer.backend.precision)
        if scale is not None:
            values["kit_loss_scale"] = scale
        self.trainer.log_metrics(values)
        self.list_checkpoints()

    def list_checkpoints(self) -> None:
        """Keep what ``save_dir`` holds now, when it differs from the last listing kept."""
        if self.save_dir is None:
            return
        listing = checkpoint_listing(self.save_dir, getattr(self.trainer.backend, "checkpoint_suffix", ".pt") or ".pt")
        if not self.listings or self.listings[-1] != listing:
            self.listings.append(listing)


def observed_path(trainer: Any, trajectory: Trajectory) -> Dict[str, Any]:
    """A finished run's trajectory as observations: ``history`` (every recorded value, in order:
    losses, logged metrics, ``grad_norm``, learning rates, loss scale), ``series`` (each value's
    name and step), ``started`` and ``saved`` (the checkpoint listings; the last one taken now)."""
    trajectory.list_checkpoints()
    records = trainer.history.records
    return {
        "history": [float(record["value"]) for record in records],
        "series": [[record["name"], int(record["step"])] for record in records],
        "started": trajectory.started,
        "saved": trajectory.listings,
    }
