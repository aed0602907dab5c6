"""Config values as their fields' types: ``convert`` (command-line text or YAML values in) and
``plain`` (YAML-safe values out), for :mod:`framework.config.cli`."""

import collections.abc
import dataclasses
import enum
import types
import typing
from typing import Any, Callable, Dict, Mapping, Optional

from framework.config.bounded_repr import bounded_repr

_TRUE, _FALSE, _NONE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}, {"none", "null", "~"}
_SEQUENCES = (list, tuple, set, collections.abc.Sequence)
_UNIONS = tuple(kind for kind in (typing.Union, getattr(types, "UnionType", None)) if kind is not None)
"""``Optional[int]`` / ``Union[...]`` and PEP 604's ``int | None`` (``types.UnionType``, Python 3.10+)."""


def convert(value: Any, hint: Any, from_text: bool = True) -> Any:
    """``value`` as type ``hint``: int, float, bool, str, Optional/Union, Literal, Enum,
    List/Tuple/Dict of those, or a dataclass from a mapping; other hints pass it through.

    ``from_text`` values come from the command line (``"3"``, ``"none"``, ``"[1, 2]"``);
    others from YAML, already typed.

    Raises:
        ValueError: the value does not fit, with what was expected.

    Example:
        >>> from typing import Optional, Union
        >>> convert("0.5", Optional[Union[int, float]]), convert("none", Optional[int])
        (0.5, None)
    """
    if hint is Any or hint is object:
        return value
    if typing.get_origin(hint) in _UNIONS:
        return _to_union(value, hint, from_text)
    if value is None:
        raise ValueError(f"expected {describe(hint)}, got None")
    converter = _converter_for(hint)
    return value if converter is None else converter(value, hint, from_text)


Converter = Callable[[Any, Any, bool], Any]


def _converter_for(hint: Any) -> Optional[Converter]:
    """The conversion for one kind of type hint, or None to pass values through."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return _to_literal
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _to_enum
    if hint in _SCALARS:
        return _SCALARS[hint]
    if origin in _SEQUENCES or hint in (list, tuple):
        return _to_sequence
    if origin is dict or hint is dict:
        return _to_dict
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _to_dataclass
    return None


def _to_union(value: Any, hint: Any, from_text: bool) -> Any:
    """Optional/Union: None when allowed, else the first option that fits (errors of all joined)."""
    arguments = typing.get_args(hint)
    options = [a for a in arguments if a is not type(None)]
    if type(None) in arguments and (value is None or (from_text and str(value).lower() in _NONE)):
        return None
    if not from_text:  # a typed YAML value keeps its type when the union allows it (1.0 stays a float)
        for option in options:
            if isinstance(option, type) and type(value) is option:
                return value
    errors = []
    for option in options:
        try:
            return convert(value, option, from_text)
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    raise ValueError(" or ".join(dict.fromkeys(errors)))


def _to_literal(value: Any, hint: Any, from_text: bool) -> Any:
    choices = typing.get_args(hint)
    for choice in choices:
        if value == choice or (from_text and str(value) == str(choice)):
            return choice
    raise ValueError(f"expected one of {list(choices)}, got {bounded_repr(value)}")


def _to_enum(value: Any, hint: Any, from_text: bool) -> Any:
    for member in hint:
        if value in (member, member.value, member.name) or (from_text and str(value) in (str(member.value), member.name)):
            return member
    raise ValueError(f"expected one of {[member.name for member in hint]}, got {bounded_repr(value)}")


def _to_bool(value: Any, hint: Any, from_text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, int)) and str(value).lower() in _TRUE | _FALSE:
        return str(value).lower() in _TRUE
    raise ValueError(f"expected a boolean (true/false), got {bounded_repr(value)}")


def _to_int(value: Any, hint: Any, from_text: bool) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expected an integer, got {bounded_repr(value)}")
    try:
        return int(value.replace("_", "")) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected an integer, got {bounded_repr(value)}") from None


def _to_float(value: Any, hint: Any, from_text: bool) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {bounded_repr(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {bounded_repr(value)}") from None


def _to_str(value: Any, hint: Any, from_text: bool) -> str:
    if isinstance(value, (list, dict, tuple, set)):
        raise ValueError(f"expected a string, got {type(value).__name__} {bounded_repr(value)}")
    return str(value)


_SCALARS: Dict[Any, Converter] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _to_sequence(value: Any, hint: Any, from_text: bool) -> Any:
    """List/Sequence/Set/Tuple: from YAML text (``[1, 2]``) or comma-separated text (``1,2``)."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    items = _parse_text(value) if from_text and isinstance(value, str) else value
    if isinstance(items, str) and from_text:
        items = [part.strip() for part in items.split(",") if part.strip()]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"expected a list, got {bounded_repr(value)}")
    if origin is tuple and arguments and arguments[-1] is not Ellipsis:  # Tuple[int, str]: one hint per item
        if len(arguments) != len(items):
            raise ValueError(f"expected {len(arguments)} items, got {len(items)}: {bounded_repr(value)}")
        return tuple(convert(item, item_hint, from_text) for item, item_hint in zip(items, arguments))
    item_hint = arguments[0] if arguments else Any
    converted = [convert(item, item_hint, from_text) for item in items]
    if origin is tuple or hint is tuple:
        return tuple(converted)
    return set(converted) if origin is set else converted


def _to_dict(value: Any, hint: Any, from_text: bool) -> Dict[Any, Any]:
    mapping = _parse_text(value) if from_text and isinstance(value, str) else value
    if not isinstance(mapping, Mapping):
        raise ValueError(f"expected a mapping, got {bounded_repr(value)}")
    key_hint, value_hint = typing.get_args(hint) or (Any, Any)
    return {convert(k, key_hint, from_text): convert(v, value_hint, from_text) for k, v in mapping.items()}


def _to_dataclass(value: Any, hint: Any, from_text: bool) -> Any:
    if isinstance(value, hint):
        return value
    if isinstance(value, Mapping):
        return hint(**value)
    raise ValueError(f"expected a mapping of {hint.__name__} fields, got {bounded_repr(value)}")


def _parse_text(text: str) -> Any:
    from framework.config.bounded_yaml import YamlRefused, load_yaml

    try:
        return load_yaml(text)
    except YamlRefused as error:
        if "not valid YAML" in str(error):
            return text
        raise ValueError(str(error)) from None


def plain(value: Any) -> Any:
    """``value`` with only YAML-safe types (tuples as lists, enums as values, others as str).

    Example:
        >>> plain({"sizes": (1, 2), "path": None})
        {'sizes': [1, 2], 'path': None}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    return str(value)


def describe(hint: Any) -> str:
    """``hint`` in words for messages: ``"an integer"``, ``"a number"``, ... or its type name."""
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(hint, type_name(hint))


def type_name(hint: Any) -> str:
    """``hint`` as written in code, without ``typing.`` (``Optional[int]``, ``List[str]``)."""
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")
