"""Arguments of the default checkpointer."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DefaultCheckpointerArguments:
    """Where, when and how many checkpoints :class:`DefaultCheckpointer` keeps.

    Example:
        >>> args = DefaultCheckpointerArguments(save_dir="memory://run1", period=1, keep_last_n=2)
    """

    save_dir: Optional[str] = None
    """Directory or fsspec URL for checkpoints; None: ``<output_dir>/checkpoints``."""
    period: int = 1
    """Save every ``period`` finished epochs (0: never at epoch ends)."""
    save_every_n_steps: Optional[int] = None
    """Also save every N optimizer steps (mid-epoch saves resume exactly)."""
    save_at_end: bool = True
    """Save when training ends."""
    keep_last_n: Optional[int] = None
    """Keep only the newest N checkpoints (None: keep all)."""
    keep_best_n: int = 0
    """Also keep the best N checkpoints by ``metric``."""
    metric: str = "val_loss"
    """Metric that ranks checkpoints for ``keep_best_n``."""
    mode: str = "min"
    """``min`` or ``max``: which direction of ``metric`` is better."""
    load_dir: Optional[str] = None
    """Resume from the newest valid checkpoint in this directory or URL."""
    load_filename: Optional[str] = None
    """Resume from this checkpoint file (path or URL)."""
    resume: Optional[str] = None
    """``"auto"``: resume from ``save_dir`` when it holds a checkpoint, else start fresh."""
    reset_optimizers_schedulers: bool = False
    """On load, restore the model weights only (fresh optimizers, schedulers, counters)."""
    weights_only: bool = True
    """Load with ``torch.load(weights_only=True)``: a checkpoint cannot run code."""
    async_save: bool = False
    """Copy state to CPU on the training thread, write it on a background thread."""

    def __post_init__(self) -> None:
        for name in ("period", "keep_best_n"):
            if getattr(self, name) < 0:
                raise ValueError(f"checkpointer.{name}={getattr(self, name)} is negative; use 0 or more")
        for name in ("save_every_n_steps", "keep_last_n"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"checkpointer.{name}={value}; use a positive integer or None")
        if self.mode not in ("min", "max"):
            raise ValueError(f"checkpointer.mode={self.mode!r}; allowed: 'min', 'max'")
        if self.resume not in (None, "auto"):
            raise ValueError(f"checkpointer.resume={self.resume!r}; allowed: None, 'auto'")
