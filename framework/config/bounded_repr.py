"""Values in messages, bounded: an error or warning never grows with the value it names.

A setting that is a plain scalar is shown as its ``repr``, cut to a few hundred characters; a
list, mapping or other container is shown as written when it is small and whole, else by its
type and size (``a list of 3000 items``), with its first items when they fit in a short line.
Nothing here walks more than a few dozen items, so a value
that stands for billions of others (a YAML alias bomb) costs what a small one does.
"""

import reprlib
from typing import Any

LIMIT = 200
"""The most characters a value takes in a message."""

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 2, 6, 6, 4, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 60


def bounded_text(text: str, limit: int = LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was.

    Example:
        >>> bounded_text("x" * 1000, 20)
        'xxxxxxxxxx... (1000 characters)'
    """
    if len(text) <= limit:
        return text
    return f"{text[: max(limit // 2, 1)]}... ({len(text)} characters)"


def bounded_repr(value: Any, limit: int = LIMIT) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters.

    Example:
        >>> bounded_repr("three"), bounded_repr([1, 2])
        ("'three'", '[1, 2]')
        >>> bounded_repr(list(range(10**6)))
        'a list of 1000000 items: [0, 1, 2, 3, 4, 5, ...]'
    """
    if value is None or isinstance(value, (bool, int, float, complex)):
        return bounded_text(repr(value), limit)
    if isinstance(value, (str, bytes)):
        if len(value) <= limit * 4:
            return bounded_text(repr(value), limit)
        return f"a {type(value).__name__} of {len(value)} characters: {value[: limit // 2]!r}..."
    size = _size(value)
    kind = type(value).__name__
    if size is None:
        try:
            text = _SHORT.repr(value)
        except Exception:  # a repr that fails must not hide the message it is in
            text = f"<{kind}>"
        return bounded_text(text, limit)
    noun = "keys" if hasattr(value, "keys") else "items"
    shown = f"a {kind} of {size} {noun}"
    try:
        items = _SHORT.repr(value)
    except Exception:
        return shown
    if "..." not in items and len(items) <= limit and len(value) <= _SHORT.maxlist:
        return items  # small and whole: as written
    return shown + (f": {items}" if len(items) <= limit - len(shown) else "")


def _size(value: Any) -> Any:
    if isinstance(value, (list, tuple, set, frozenset, dict)) or hasattr(value, "keys"):
        try:
            return len(value)
        except TypeError:
            return None
    return None
