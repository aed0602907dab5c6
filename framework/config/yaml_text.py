"""YAML text of plain values (what ``config.yaml`` holds), written without importing PyYAML.

Importing PyYAML costs about 15 ms in a fresh process, most of a short run's fixed cost; the
resolved config is only plain values (``None``, booleans, numbers, strings, lists and
mappings with string keys: :func:`framework.config.conversion.plain`), which this writes
in block style. A string is written plain only where it starts with a letter, ``_`` or ``/``,
holds only letters, digits and ``_./-`` and is not a YAML 1.1 word (``yes``, ``off``,
``null``); every other string is double-quoted, so none reads back as another type. Floats
are written as PyYAML writes them (``1.0e-05``, ``.inf``, ``.nan``), so ``yaml.safe_load``
returns exactly the values written.
"""

import math
import re
from typing import Any, List, Mapping

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*\Z")  # no plain scalar of another type starts or looks like this
_RESERVED_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}  # YAML 1.1 reads these as bool/None
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"}


def to_yaml(data: Mapping[str, Any]) -> str:
    """``data`` as block-style YAML text that ``yaml.safe_load`` reads back equal.

    Raises:
        TypeError: a value is not ``None``, a bool, int, float, str, list, tuple or a mapping
            with string keys (names the value and its path).

    Example:
        >>> print(to_yaml({"trainer": {"epochs": 3, "lr": 1e-05, "backend": "sp", "gpus": [0, 1]}}), end="")
        trainer:
          epochs: 3
          lr: 1.0e-05
          backend: sp
          gpus:
          - 0
          - 1
    """
    lines: List[str] = []
    _write_mapping(data, "", lines, "")
    return "".join(line + "\n" for line in lines)


def _write_mapping(mapping: Mapping[Any, Any], indent: str, lines: List[str], path: str) -> None:
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise TypeError(f"config key {path}{key!r} must be a string, got {type(key).__name__}")
        _write_entry(f"{indent}{_string(key)}:", value, indent, lines, f"{path}{key}.")


def _write_entry(head: str, value: Any, indent: str, lines: List[str], path: str) -> None:
    """``head`` (``key:`` or ``-``) followed by ``value``: on the same line when a scalar or
    empty, else on the lines below, indented."""
    if isinstance(value, Mapping) and value:
        lines.append(head)
        _write_mapping(value, indent + "  ", lines, path)
    elif isinstance(value, (list, tuple)) and value:
        lines.append(head)
        for index, item in enumerate(value):
            _write_entry(f"{indent}-", item, indent + "  ", lines, f"{path}{index}.")
    else:
        lines.append(f"{head} {_scalar(value, path)}")


def _string(text: str) -> str:
    return text if _PLAIN.match(text) and text.lower() not in _RESERVED_WORDS else _quoted(text)


def _scalar(value: Any, path: str) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    raise TypeError(
        f"config value {path.rstrip('.')} = {value!r} is a {type(value).__name__}: "
        "allowed are None, bool, int, float, str, lists and mappings with string keys"
    )


def _float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = float.__repr__(value)
    if "." not in text:  # YAML 1.1 reads 1e-05 as a string: it needs the dot, as in 1.0e-05
        mantissa, _, exponent = text.partition("e")
        text = f"{mantissa}.0e{exponent}" if exponent else f"{mantissa}.0"
    return text


def _quoted(text: str) -> str:
    return '"' + "".join(_ESCAPES.get(char) or _escaped(char) for char in text) + '"'


def _escaped(char: str) -> str:
    """``char`` itself where printable ASCII, else its escape: the file is ASCII, as PyYAML's."""
    code = ord(char)
    if 0x20 <= code <= 0x7E:
        return char
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
