"""AbstractCheckpointer: the interface the trainer saves and loads through."""

import abc
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from backends.checkpoint_io.stateful import refuse_renamed_state_methods
from backends.strategies import SingleProcess, Strategy
from framework.checkpoint.checkpoint import Checkpoint


class AbstractCheckpointer(abc.ABC):
    """Decides when checkpoints are written, where they go and which one a run resumes from.

    The trainer hands it the strategy (:meth:`setup`), calls :meth:`prepare_run` once on rank
    zero before anything is written, then :meth:`load_into` once before training; :meth:`save`
    at every epoch end (``epoch`` = epochs finished) and, with ``force=True``, on demand, at
    step triggers and at the end. Every rank calls :meth:`save` and :meth:`load_into`, with the
    same arguments: the files themselves are written and read through
    ``self.strategy.save_checkpoint`` / ``load_checkpoint`` (one file from rank zero, or shards
    from every rank), so a checkpointer holds policy only and works on every backend. State it
    keeps inside checkpoints goes through :meth:`state_dict` / :meth:`load_state_dict` (a
    subclass defining the old names ``get_state`` / ``update_state`` is refused at definition).

    Example:
        >>> class InMemory(AbstractCheckpointer):
        ...     def __init__(self):
        ...         self.saved = {}
        ...     def save(self, checkpoint, epoch, force=False):
        ...         self.saved[checkpoint.global_step] = checkpoint
        ...     def save_model(self, state, step):
        ...         pass
        ...     def load(self):
        ...         return self.saved[max(self.saved)] if self.saved else None
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_renamed_state_methods(cls, "docs/checkpointing.md")

    strategy: Strategy = SingleProcess()
    """Where the run's processes are (set by :meth:`setup`; one process until then)."""
    loaded_from: Optional[str] = None
    """Path or URL of the checkpoint :meth:`load_into` returned, for messages; None when unknown."""
    save_dir: Optional[str] = None
    """Where this checkpointer writes (``checkpoint="last"``/``"best"`` look there); None: nowhere."""
    weights_only: bool = True
    """Reads refuse pickled objects (``torch.load(weights_only=True)``)."""
    metric: str = "val_loss"
    """The metric that ranks checkpoints for ``checkpoint="best"``, and whether lower is better (``mode``)."""
    mode: str = "min"

    def setup(self, strategy: Strategy) -> None:
        """Told once, by the trainer, which strategy writes and reads the checkpoints."""
        self.strategy = strategy

    @abc.abstractmethod
    def save(self, checkpoint: Checkpoint, epoch: int, force: bool = False) -> Optional[str]:
        """Save ``checkpoint`` if a save is due after ``epoch`` epochs finished (or ``force``);
        return where it went, or None. The trainer passes both positionally."""

    @abc.abstractmethod
    def save_model(self, state: Dict[str, Any], step: int) -> Optional[str]:
        """Write a model-only export (e.g. for inference) taken after ``step`` optimizer steps;
        return where it went."""

    @abc.abstractmethod
    def load(self) -> Optional[Checkpoint]:
        """The checkpoint to resume from, or None to start fresh."""

    def load_into(self, current: Callable[[], Checkpoint], optimizers: Sequence[torch.optim.Optimizer]) -> Optional[Checkpoint]:
        """What the trainer calls to resume (on every rank): by default :meth:`load`.

        :class:`DefaultCheckpointer` reads through the strategy into the tensors of ``current()``
        (this run's state, in its own sharding under ``fsdp``), creating ``optimizers``' state first.
        """
        return self.load()

    def is_epoch_save_due(self, epochs_finished: int) -> bool:
        """True when :meth:`save` would keep the epoch-end checkpoint ``epochs_finished`` (the
        trainer builds the checkpoint's state only then)."""
        return True

    def continues_existing_run(self) -> bool:
        """True when this run is declared to continue the run whose files are already in its
        directories (e.g. ``resume="auto"``): then those files are its own, not another run's,
        and ``output_dir`` may be reused."""
        return False

    def prepare_run(self) -> None:
        """Called once on rank zero at setup, before anything is written: refuse (raise
        :class:`framework.run.run_directory.RunDirectoryInUse`) when the save location holds another
        run's checkpoints that this run does not continue; tidy leftovers of killed saves."""

    def is_step_save_due(self, global_step: int) -> bool:
        """True when a mid-epoch save is due after optimizer step ``global_step``."""
        return False

    def saves_at_end(self) -> bool:
        """True when the trainer should save a final checkpoint when training ends."""
        return True

    def restores_model_only(self) -> bool:
        """True when the checkpoint :meth:`load` returned should restore the model weights only
        (fresh optimizers, schedulers and counters: fine-tuning from another run)."""
        return False

    def resumed_automatically(self) -> bool:
        """True when the checkpoint :meth:`load` returned was found by ``resume="auto"`` in this
        run's own save location (it must then be this run's: see framework/run/run_identity.py);
        False when the user named it (``load_dir``/``load_filename``)."""
        return False

    def describe(self) -> Optional[str]:
        """One line on when checkpoints are written, where, and how many are kept (logged when
        training starts), or None to log nothing."""
        return None

    def wait(self) -> None:
        """Block until background writes finish; re-raise their errors."""

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by :attr:`metric` among those this run scored, or None."""
        return None

    def resume_source(self) -> Optional[str]:
        """The checkpoint or directory a run would resume from, or None."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """Checkpointer state kept inside checkpoints (e.g. scores for best-k retention)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
