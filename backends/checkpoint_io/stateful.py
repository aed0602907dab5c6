"""One state vocabulary: every internal component with state speaks torch's ``state_dict()`` /
``load_state_dict()`` (callbacks, checkpointers, the trainer's parts, backends and precisions). The module is the
exception: its ``state_dict()`` is its weights, so the user's own state is ``get_state()`` /
``update_state()`` on :class:`~framework.ModuleInterface`."""

from typing import Dict

RENAMED_STATE_METHODS: Dict[str, str] = {"get_state": "state_dict", "update_state": "load_state_dict"}
"""The state methods plugins (callbacks, checkpointers, backends, precisions) used to define, and their names now."""


def refuse_renamed_state_methods(cls: type, docs: str) -> None:
    """Raise when ``cls`` (a user's callback, checkpointer, backend or precision class) defines the state methods
    under their old names, which the trainer no longer calls: its state would be lost silently.

    Args:
        cls: the class being defined (call from ``__init_subclass__``).
        docs: where the protocol is described, named in the message.

    Raises:
        TypeError: ``cls`` defines ``get_state`` or ``update_state``.

    Example:
        >>> class Counter:
        ...     def get_state(self):
        ...         return {}
        >>> refuse_renamed_state_methods(Counter, "docs/callbacks.md")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Counter defines get_state, ...: rename get_state -> state_dict and update_state -> load_state_dict ...
    """
    old = [name for name in RENAMED_STATE_METHODS if name in vars(cls)]
    if old:
        raise TypeError(
            f"{cls.__name__} defines {' and '.join(old)}, which the trainer no longer calls, so its state would not be "
            f"saved: rename get_state -> state_dict and update_state -> load_state_dict (torch's protocol; see {docs})"
        )
