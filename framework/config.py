"""Run configuration: dataclass sections loaded from YAML and overridden on the command line.

``--config run.yaml`` loads a file whose top-level keys are section names; ``--SECTION.FIELD
VALUE`` (or ``--SECTION.FIELD=VALUE``) overrides one field; ``--backend NAME`` is short for
``--trainer.backend NAME``. Values are checked against the field types, an unknown key is
an error that suggests the closest valid one, and ``--help`` lists every field with its
default and description.
"""

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import textwrap
import typing
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

import yaml

from framework.arguments import TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments

DEFAULT_SECTIONS: Dict[str, Type] = {"trainer": TrainerArguments, "checkpointer": DefaultCheckpointerArguments}
SHORTCUTS = {"backend": "trainer.backend"}
_TRUE, _FALSE, _NONE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}, {"none", "null", "~"}


class ConfigError(ValueError):
    """A config file or command-line override that does not fit the sections."""


class RunConfig:
    """The parsed sections, as attributes: ``config.trainer``, ``config.checkpointer``, ...

    ``config.trainer.checkpointer_args`` is the ``checkpointer`` section, so
    ``Trainer(module, config.trainer)`` uses both.

    Example:
        >>> config = parse_config(argv=["--trainer.epochs", "3", "--backend", "sp"])
        >>> config.trainer.epochs, config.trainer.backend
        (3, 'sp')
    """

    def __init__(self, sections: Dict[str, Any]) -> None:
        self.sections = sections
        for name, value in sections.items():
            setattr(self, name, value)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Every section as a plain dict (the trainer's checkpointer section stands alone)."""
        result = {}
        for name, section in self.sections.items():
            values = dataclasses.asdict(section)
            if isinstance(section, TrainerArguments):
                values.pop("checkpointer_args")
            result[name] = values
        return result

    def save(self, path: str) -> None:
        """Write the resolved configuration as YAML (loadable with ``--config``)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            yaml.safe_dump(self.to_dict(), handle, sort_keys=False)


def parse_config(
    sections: Optional[Mapping[str, Type]] = None,
    argv: Optional[Sequence[str]] = None,
    program: str = "run.py",
) -> RunConfig:
    """Build every section from defaults, then ``--config FILE``, then CLI overrides.

    Args:
        sections: extra ``{name: dataclass}`` sections (the user's own); ``trainer`` and
            ``checkpointer`` are always there.
        argv: command-line arguments (default: ``sys.argv[1:]``).
        program: the name shown by ``--help``.

    Raises:
        ConfigError: unknown keys (with a suggestion), bad values, a missing file.
    """
    classes = dict(DEFAULT_SECTIONS)
    classes.update(sections or {})
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(classes, program))
        raise SystemExit(0)
    config_path, overrides = _split_arguments(argv)
    values: Dict[str, Dict[str, Any]] = {name: {} for name in classes}
    if config_path is not None:
        for key, value in _flatten(_load_yaml(config_path)).items():
            _assign(values, classes, key, value, source=config_path, from_text=False)
    for key, text in overrides:
        _assign(values, classes, key, text, source="command line", from_text=True)
    built = {}
    for name, cls in classes.items():
        try:
            built[name] = cls(**values[name])
        except (TypeError, ValueError) as error:
            raise ConfigError(f"section {name!r}: {error}") from error
    trainer = built["trainer"]
    trainer.checkpointer_args = built["checkpointer"]
    return RunConfig(built)


def _split_arguments(argv: List[str]):
    config_path, overrides, index = None, [], 0
    while index < len(argv):
        item = argv[index]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r}; use --config FILE or --section.field VALUE")
        key, has_value, value = item[2:].partition("=")
        if not has_value:
            if index + 1 >= len(argv) or argv[index + 1].startswith("--"):
                raise ConfigError(f"--{key} needs a value")
            value = argv[index + 1]
            index += 1
        index += 1
        if key == "config":
            config_path = value
        else:
            overrides.append((SHORTCUTS.get(key, key), value))
    return config_path, overrides


def _load_yaml(path: str) -> Dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    flat = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and "." not in dotted:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[SHORTCUTS.get(dotted, dotted)] = value
    return flat


def _assign(values, classes, key: str, value: Any, source: str, from_text: bool) -> None:
    fields = {f"{section}.{f.name}": f for section, cls in classes.items() for f in dataclasses.fields(cls)}
    fields.pop("trainer.checkpointer_args", None)
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields) + list(SHORTCUTS), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid sections: {sorted(classes)}"
        raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
    section, name = key.split(".", 1)
    hint = typing.get_type_hints(classes[section])[name]
    try:
        values[section][name] = convert(value, hint, from_text)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key}={value!r} (from {source}): {error}") from None


def convert(value: Any, hint: Any, from_text: bool = True) -> Any:
    """``value`` as type ``hint`` (int, float, bool, str, Optional[...], Union[...])."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if type(None) in arguments and (value is None or (from_text and str(value).lower() in _NONE)):
            return None
        errors = []
        for option in (a for a in arguments if a is not type(None)):
            try:
                return convert(value, option, from_text)
            except (TypeError, ValueError) as error:
                errors.append(str(error))
        raise ValueError("; ".join(errors))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise ValueError(f"expected a boolean (true/false), got {value!r}")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value) if not isinstance(value, str) else int(value.replace("_", ""))
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if hint is str:
        return str(value)
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return hint(**value)
    return value


def field_docs(cls: Type) -> Dict[str, str]:
    """The string literal under each dataclass field (its attribute docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def format_help(classes: Mapping[str, Type], program: str = "run.py") -> str:
    """The ``--help`` text: every section and field with type, default and description."""
    lines = [
        f"usage: {program} [--config FILE.yaml] [--SECTION.FIELD VALUE ...] [--backend NAME]",
        "",
        "Values come from the field defaults, then --config, then the command line.",
    ]
    for section, cls in classes.items():
        lines += ["", f"{section}:"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "checkpointer_args":
                continue
            default = f.default if f.default is not dataclasses.MISSING else "(factory)"
            type_name = f.type.__name__ if isinstance(f.type, type) else str(f.type).replace("typing.", "")
            lines.append(f"  --{section}.{f.name} ({type_name}, default {default!r})")
            if f.name in docs:
                lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
