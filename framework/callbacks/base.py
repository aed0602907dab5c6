"""Callback: the hooks of the training loop, as objects."""

from typing import TYPE_CHECKING, Any, Dict

from backends.stateful import refuse_renamed_state_methods
from framework.loop.hooks import TrainingHooks

if TYPE_CHECKING:
    from framework.loop.view import TrainerView


class StopTraining(Exception):
    """Raise from any hook to end training cleanly.

    The trainer catches it, calls ``on_end_train`` and, unless ``save_checkpoint`` is
    False, saves the final checkpoint. Raise it with ``save_checkpoint=False`` when the
    model must not be kept (for example after a NaN loss).

    Args:
        message: why training stopped; the trainer logs it.
        save_checkpoint: whether the trainer saves the final checkpoint.

    Example:
        >>> class StopAtStep(Callback):
        ...     def on_end_optimizer_step(self, global_step):
        ...         if global_step == 100:
        ...             raise StopTraining("reached step 100")
    """

    def __init__(self, message: str = "", save_checkpoint: bool = True) -> None:
        super().__init__(message)
        self.save_checkpoint = save_checkpoint


class Callback(TrainingHooks):
    """Hooks with the same names and arguments as :class:`~framework.ModuleInterface`'s.

    The trainer calls the module's hook, then each callback's, in list order. Before
    training it calls :meth:`setup`, so hooks can reach ``self.trainer`` (its ``history``,
    ``module``, ``should_stop``...). A callback with state speaks torch's protocol: it returns
    the state from :meth:`state_dict`, which is saved in checkpoints, and :meth:`load_state_dict`
    restores it on resume. A subclass that still defines the old names ``get_state`` /
    ``update_state`` is refused with a ``TypeError`` when the class is defined.

    Example:
        >>> class PrintEpochs(Callback):
        ...     def on_begin_train_epoch(self, global_step, epoch):
        ...         print("epoch", epoch, "from step", global_step)
    """

    trainer: "TrainerView"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_renamed_state_methods(cls, "docs/callbacks.md")

    def setup(self, trainer: "TrainerView") -> None:
        """Called once before training, validation or testing starts."""
        self.trainer = trainer

    def state_dict(self) -> Dict[str, Any]:
        """State to keep in checkpoints."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
