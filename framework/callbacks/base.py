"""Callback: the hooks of the training loop, as objects."""

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from backends.checkpoint_io.stateful import refuse_renamed_state_methods
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

    def load_evaluation_state(self, state: Optional[Dict[str, Any]]) -> None:
        """``validate``/``test``/``predict(checkpoint=...)`` loaded a checkpoint's weights: restore
        from ``state`` (what :meth:`state_dict` returned when that checkpoint was saved; None: the
        checkpoint holds none, e.g. a weights export) whatever decides which weights are
        evaluated, so they are evaluated as training did at that step. Training state (an early
        stopping counter...) stays as it is: the default does nothing.

        Example:
            >>> class Scale(Callback):
            ...     def load_evaluation_state(self, state):
            ...         self.factor = 1.0 if state is None else state["factor"]
        """


def callback_states(callbacks: Sequence[Callback]) -> List[Dict[str, Any]]:
    """What a checkpoint keeps of ``callbacks``: ``{"type": class name, "state": state_dict()}``, in order.

    Example:
        >>> callback_states([Callback()])
        [{'type': 'Callback', 'state': {}}]
    """
    return [{"type": type(callback).__name__, "state": callback.state_dict()} for callback in callbacks]


def saved_states(
    callbacks: Sequence[Callback], saved: Sequence[Dict[str, Any]]
) -> List[Tuple[Callback, Optional[Dict[str, Any]]]]:
    """Each callback with the state :func:`callback_states` saved for it (None: none), matched by
    class name in order (the second callback of a class gets the second state of that class).

    Example:
        >>> first, second = Callback(), Callback()
        >>> [state for _, state in saved_states([first, second], [{"type": "Callback", "state": {"n": 1}}])]
        [{'n': 1}, None]
    """
    remaining = list(saved)
    pairs: List[Tuple[Callback, Optional[Dict[str, Any]]]] = []
    for callback in callbacks:
        match = next((entry for entry in remaining if entry.get("type") == type(callback).__name__), None)
        if match is not None:
            remaining.remove(match)
        pairs.append((callback, None if match is None else match["state"]))
    return pairs
