"""Arguments of the default checkpointer."""

from dataclasses import dataclass
from typing import Optional

from framework.checkpoint.storage_check import check_protocols
from framework.config.typed_fields import check_field_types


@dataclass
class DefaultCheckpointerArguments:
    """Where, when and how many checkpoints :class:`DefaultCheckpointer` keeps, and what a run resumes from.

    Resuming: with ``resume="auto"`` a run whose ``save_dir`` holds a checkpoint continues
    from the newest readable one (so restarting the same command continues a killed run);
    otherwise ``load_filename``, then the newest readable checkpoint in ``load_dir``; with
    none of them, or an empty directory, the run starts fresh. A run that does not continue
    the run in ``save_dir`` (``resume="auto"``, or ``load_dir``/``load_filename`` inside it)
    refuses to start there if it holds checkpoints. See docs/checkpointing.md.

    Example:
        >>> args = DefaultCheckpointerArguments(save_dir="memory://run1", period=1, keep_last_n=2, resume="auto")
    """

    save_dir: Optional[str] = None
    """Directory or fsspec URL for checkpoints; None: ``<output_dir>/checkpoints``."""
    period: int = 1
    """Save every ``period`` finished epochs (0: never at epoch ends)."""
    save_every_n_steps: Optional[int] = None
    """Also save every N optimizer steps (mid-epoch saves resume exactly)."""
    save_at_end: bool = True
    """Save when training ends."""
    keep_last_n: Optional[int] = 3
    """Keep only the newest N checkpoints, plus the ``keep_best_n`` best (None: keep all; 0 with
    ``keep_best_n=K``: only the best K, as Lightning's ``ModelCheckpoint(save_top_k=K)``)."""
    keep_best_n: int = 0
    """With ``keep_last_n``, also keep the best N checkpoints by ``metric``."""
    metric: str = "val_loss"
    """Metric that ranks checkpoints for ``keep_best_n``: its value recorded at the checkpoint's step."""
    mode: str = "min"
    """``min`` or ``max``: which direction of ``metric`` is better."""
    load_dir: Optional[str] = None
    """Resume from the newest readable checkpoint in this directory or URL (empty or missing: start fresh)."""
    load_filename: Optional[str] = None
    """Resume from this checkpoint file (path or URL); it must exist and read back."""
    resume: Optional[str] = None
    """``"auto"``: resume from ``save_dir`` when it holds a checkpoint (before ``load_filename``/``load_dir``)."""
    reset_optimizers_schedulers: bool = False
    """Loading from ``load_filename``/``load_dir``, restore the model weights only (fresh optimizers,
    schedulers, counters); a restart that resumes this run's own ``save_dir`` still restores everything."""
    weights_only: bool = True
    """Load with ``torch.load(weights_only=True)``: a checkpoint cannot run code. False trusts pickled objects."""
    async_save: bool = False
    """Copy state to CPU on the training thread, write it on a background thread (one save in flight)."""
    save_non_finite: bool = False
    """Also write checkpoints whose weights or ``metric`` hold NaN/inf (default: skip them with a warning)."""

    def __post_init__(self) -> None:
        check_field_types(self, "checkpointer")
        check_protocols({"save_dir": self.save_dir, "load_dir": self.load_dir, "load_filename": self.load_filename})
        for name in ("period", "keep_best_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"checkpointer.{name}={value!r} is invalid; allowed: an integer >= 0")
        for name, least in (("save_every_n_steps", 1), ("keep_last_n", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"checkpointer.{name}={value!r} is invalid; allowed: None or an integer >= {least}")
        if self.keep_last_n == 0 and self.keep_best_n == 0:
            raise ValueError(
                "checkpointer.keep_last_n=0 with keep_best_n=0 would delete every checkpoint it writes; "
                "allowed: keep_best_n >= 1 (keep only the best, as Lightning's save_top_k) or keep_last_n >= 1"
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"checkpointer.mode={self.mode!r}; allowed: 'min', 'max'")
        if self.resume not in (None, "auto"):
            raise ValueError(f"checkpointer.resume={self.resume!r}; allowed: None, 'auto'")
