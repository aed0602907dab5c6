"""Checking a dataclass's field values against its field types (no conversion, no coercion)."""

import dataclasses
import os
import types
import typing
from typing import Any

_UNIONS = tuple(kind for kind in (typing.Union, getattr(types, "UnionType", None)) if kind is not None)
"""``Optional[X]`` / ``Union[...]`` and PEP 604's ``X | None`` (Python 3.10+)."""


def matches_type(value: Any, hint: Any) -> bool:
    """True when ``value`` fits the type ``hint`` exactly as written.

    ``bool`` is not an ``int`` here (``epochs=True`` is refused), an ``int`` is a ``float``
    (``max_time=10`` is fine), a ``str`` is never a number, and ``Optional[X]`` admits None.
    Hints it does not know (``Any``, containers, callables) admit anything.

    Example:
        >>> matches_type(3, int), matches_type(True, int), matches_type(2.5, int), matches_type("3", int)
        (True, False, False, False)
        >>> from typing import Optional, Union
        >>> matches_type(None, Optional[bool]), matches_type("no", Optional[bool]), matches_type(0.5, Union[int, float])
        (True, False, True)
    """
    if hint is Any or hint is object:
        return True
    if typing.get_origin(hint) in _UNIONS:
        return any(matches_type(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe_type(hint: Any) -> str:
    """``hint`` in words, as an error message says what is allowed.

    Example:
        >>> from typing import Optional, Union
        >>> describe_type(Optional[Union[int, float]])
        'None, an integer or a number'
    """
    words = {bool: "a boolean (True/False)", int: "an integer", float: "a number", str: "a string", type(None): "None"}
    if typing.get_origin(hint) in _UNIONS:
        options = sorted(typing.get_args(hint), key=lambda option: option is not type(None))  # None first
        parts = [describe_type(option) for option in options]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if hint in words:
        return words[hint]
    return getattr(hint, "__name__", str(hint))


def check_field_types(instance: Any, prefix: str) -> None:
    """Raise for the first field of the dataclass ``instance`` whose value does not fit its type.

    A ``pathlib.Path`` given to a string field is accepted and stored as its ``str``.

    Args:
        instance: a dataclass instance (called from its ``__post_init__``).
        prefix: how messages name the fields, e.g. ``"TrainerArguments"`` gives
            ``TrainerArguments.epochs=2.5``.

    Raises:
        TypeError: naming the field, the value, its type and what the field allows.

    Example:
        >>> @dataclasses.dataclass
        ... class Run:
        ...     epochs: int = 1
        >>> check_field_types(Run(epochs=2.5), "Run")
        Traceback (most recent call last):
        ...
        TypeError: Run.epochs=2.5 (a float) is invalid; allowed: an integer
    """
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        value, hint = getattr(instance, field.name), hints.get(field.name, Any)
        if isinstance(value, os.PathLike) and matches_type("", hint):
            value = os.fspath(value)
            setattr(instance, field.name, value)
        if not matches_type(value, hint):
            raise TypeError(
                f"{prefix}.{field.name}={value!r} (a {type(value).__name__}) is invalid; allowed: {describe_type(hint)}"
            )
