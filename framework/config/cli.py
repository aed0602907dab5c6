"""Run configuration: dataclass sections loaded from YAML and overridden on the command line.

``--config run.yaml`` loads a file whose top-level keys are section names; ``--SECTION.FIELD
VALUE`` (or ``--SECTION.FIELD=VALUE``) overrides one field; ``--backend NAME`` is short for
``--trainer.backend NAME``; a boolean field given without a value is set to true. Values are
checked against the field types, an unknown key is an error that suggests the closest valid
one, and ``--help`` lists every field with its default and description. A section may be
LightningCLI's ``class_path`` / ``init_args`` (framework/config/class_path.py); ``--print_config`` prints
the resolved config as YAML and exits.
"""

import dataclasses
import difflib
import logging
import os
import sys
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from backends.checkpoint_io import run_files
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.config.arguments import TrainerArguments
from framework.config.backend_options import gather_backend_options
from framework.config.bounded_repr import bounded_repr
from framework.config.bounded_yaml import YamlRefused, load_yaml
from framework.config.class_path import (
    HANDED_TO_MODEL,
    SPEC_SECTIONS,
    apply_class_override,
    build,
    build_module,
    check_callbacks,
    check_class_spec,
    check_handed_sections,
    is_class_override,
)
from framework.config.conversion import convert, plain, type_name
from framework.config.help import _HIDDEN_FIELDS, _usage, format_help
from framework.config.lightning_names import LIGHTNING_ALIASES, LIGHTNING_HINTS, LIGHTNING_TOP_LEVEL
from framework.config.yaml_text import to_yaml
from framework.run.run_identity import RUN_ID_KEY

logger = logging.getLogger("framework")
DEFAULT_SECTIONS: Dict[str, Type] = {"trainer": TrainerArguments, "checkpointer": DefaultCheckpointerArguments}
SHORTCUTS = {"backend": "trainer.backend"}
_NO_VALUE = object()  # a flag given without a value: true for booleans, an error otherwise
__all__ = ["ConfigError", "RunConfig", "convert", "format_help", "parse_config", "resolved_config", "suggest"]


class ConfigError(ValueError):
    """A config file or command-line override that does not fit the sections."""


class RunConfig:
    """The parsed sections, as attributes: ``config.trainer``, ``config.checkpointer``, ...

    ``config.trainer.checkpointer_args`` is the ``checkpointer`` section, so
    ``Trainer(module, config.trainer)`` uses both. ``config.trainer.run_config`` is this
    config, so the trainer saves all of it (your own sections included) to
    ``<output_dir>/config.yaml`` when training starts.

    Example:
        >>> config = parse_config(argv=["--trainer.epochs", "3", "--backend", "sp"])
        >>> config.trainer.epochs, config.trainer.backend
        (3, 'sp')
    """

    def __init__(self, sections: Dict[str, Any]) -> None:
        self.sections = sections
        self.class_specs: Dict[str, Dict[str, Any]] = {}  # sections given as class_path / init_args
        self.callback_specs: List[Dict[str, Any]] = []  # trainer.callbacks, as class_path / init_args
        for name, value in sections.items():
            setattr(self, name, value)

    def build_module(self, default: Optional[Callable[[], Any]] = None) -> Any:
        """The module the ``model`` section's ``class_path`` names (with ``optimizer=`` from an
        ``optimizer`` section), else ``default()`` (see framework/config/class_path.py)."""
        if "model" not in self.class_specs and default is not None:
            return default()
        return build_module(self.class_specs)

    def build_callbacks(self) -> List[Any]:
        """The callbacks ``trainer.callbacks`` names (LightningCLI's list of ``class_path`` / ``init_args``),
        built; the :class:`~framework.Trainer` adds them after its ``callbacks=`` argument."""
        return [build(spec) for spec in self.callback_specs]

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Every section as plain YAML-safe values; the checkpointer section is the trainer's
        ``checkpointer_args``."""
        result = {}
        for name, section in self.sections.items():
            if isinstance(section, TrainerArguments):
                values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name != "checkpointer_args"}
            elif dataclasses.is_dataclass(section):
                values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
            else:
                values = section
            result[name] = plain(values)
        result.update({name: plain(spec) for name, spec in self.class_specs.items()})
        if self.callback_specs and "trainer" in result:
            result["trainer"]["callbacks"] = plain(self.callback_specs)
        trainer = self.sections.get("trainer")
        if isinstance(trainer, TrainerArguments) and "checkpointer" in result:
            result["checkpointer"] = plain(dataclasses.asdict(trainer.checkpointer_args))
        return result

    def save(self, path: str, run_id: Optional[str] = None) -> None:
        """Write the resolved configuration as YAML (loadable with ``--config``), with the
        run's id first (``run_id``, which ``--config`` ignores: see framework/run/run_identity.py)."""
        data: Dict[str, Any] = {} if run_id is None else {RUN_ID_KEY: run_id}
        data.update(self.to_dict())
        # Without importing PyYAML (~15 ms in a fresh process); atomically, replacing a link rather than writing through it.
        run_files.write_bytes(path, to_yaml(data).encode("utf-8"), run_files.CONFIG)


def resolved_config(args: TrainerArguments) -> RunConfig:
    """The :class:`RunConfig` that :func:`parse_config` built ``args`` in (``args.run_config``,
    with the user's own sections), or, for arguments built in code (or copied), one with the
    ``trainer`` and ``checkpointer`` sections.

    Example:
        >>> list(resolved_config(TrainerArguments(epochs=2)).to_dict())
        ['trainer', 'checkpointer']
    """
    config = args.run_config
    if config is not None and config.sections.get("trainer") is args:
        return config
    return RunConfig({"trainer": args, "checkpointer": args.checkpointer_args})


def config_callbacks(args: TrainerArguments) -> List[Any]:
    """The callbacks the config of ``args`` names in ``trainer.callbacks``, built ([] for arguments built in code).

    Example:
        >>> config_callbacks(TrainerArguments())
        []
    """
    return resolved_config(args).build_callbacks()


def own_copy(args: TrainerArguments) -> TrainerArguments:
    """A copy of ``args`` the trainer may change (its ``output_dir`` moves to ``version_<N>``), still
    saved with the user's own config sections.

    Example:
        >>> config = parse_config(argv=["--trainer.epochs", "3"])
        >>> copy = own_copy(config.trainer)
        >>> copy is not config.trainer, resolved_config(copy).trainer is copy
        (True, True)
    """
    copy = dataclasses.replace(args)
    config = args.run_config
    if config is not None and config.sections.get("trainer") is args:
        copy.run_config = RunConfig({**config.sections, "trainer": copy})
        copy.run_config.class_specs = config.class_specs
        copy.run_config.callback_specs = config.callback_specs
    return copy


def parse_config(
    sections: Optional[Mapping[str, Type]] = None,
    argv: Optional[Sequence[str]] = None,
    program: Optional[str] = None,
    exit_on_error: Optional[bool] = None,
) -> RunConfig:
    """Build every section from defaults, then ``--config FILE``, then CLI overrides.

    Args:
        sections: extra ``{name: dataclass}`` sections (the user's own); ``trainer`` and
            ``checkpointer`` are always there.
        argv: command-line arguments (default: ``sys.argv[1:]``).
        program: the name shown by ``--help`` and in errors (default: the script's name, as argparse's ``prog``).
        exit_on_error: print ``usage`` and ``<program>: error: <message>`` to stderr and exit
            with status 2 (as argparse does) instead of raising :class:`ConfigError`.
            Default: True when ``argv`` is None (a real command line), else False.

    Raises:
        ConfigError: unknown keys (with a suggestion), bad values, a missing file.
        SystemExit: after printing the help for ``-h``/``--help`` (status 0), or a config
            error with ``exit_on_error`` (status 2).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Model:
        ...     width: int = 64
        >>> config = parse_config({"model": Model}, argv=["--model.width=128"])
        >>> config.model.width
        128
    """
    classes, program = dict(DEFAULT_SECTIONS), program or os.path.basename(sys.argv[0]) or "run.py"
    for name, cls in (sections or {}).items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"section {name!r} must be a dataclass type, got {cls!r}")
        if not name.isidentifier():
            raise ValueError(f"section name {name!r} must be an identifier (letters, digits, underscores)")
        classes[name] = cls
    if exit_on_error is None:
        exit_on_error = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--print_config" in argv:  # as LightningCLI: the resolved config as YAML (loadable with --config), then exit
        config = _build_or_exit(classes, [arg for arg in argv if arg != "--print_config"], program, exit_on_error)
        print(to_yaml(config.to_dict()), end="")
        raise SystemExit(0)
    if "-h" in argv or "--help" in argv:
        rest = [arg for arg in argv if arg not in ("-h", "--help")]
        try:
            current: Optional[RunConfig] = _build(classes, rest) if rest else None
        except ConfigError:
            current = None
        print(format_help(classes, program, current))
        raise SystemExit(0)
    return _build_or_exit(classes, argv, program, exit_on_error)


def _build_or_exit(classes: Dict[str, Type], argv: List[str], program: str, exit_on_error: bool) -> RunConfig:
    try:
        return _build(classes, argv)
    except ConfigError as error:
        if not exit_on_error:
            raise
        print(f"{_usage(program)}\n{program}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _build(classes: Dict[str, Type], argv: List[str]) -> RunConfig:
    config_path, overrides = _split_arguments(argv)
    values: Dict[str, Dict[str, Any]] = {name: {} for name in classes}
    fields = _field_index(classes)
    given: List[Tuple[str, Any, str, bool]] = []  # (key, value, source, from_text), in order
    data = _load_yaml(config_path) if config_path is not None else {}
    errors: List[str] = []
    specs = {name: dict(value) for name, value in data.items() if _names_class(name, value)}  # class_path / init_args
    callback_specs: Any = []
    if config_path is not None:
        flat = _flatten(data, config_path, errors)
        callback_specs = flat.pop("trainer.callbacks", [])
        given += [(key, value, config_path, False) for key, value in flat.items()]
    for key, text in overrides:
        if text is _NO_VALUE and is_class_override(key):
            errors.append(f"--{key} needs a value")
        elif key == "trainer.callbacks":
            try:
                callback_specs = load_yaml(text) if isinstance(text, str) else text
            except YamlRefused as error:
                errors.append(f"--trainer.callbacks: {error}")
        elif key.split(".")[0] in classes or not apply_class_override(specs, key, text):
            given.append((key, text, "command line", True))
    errors += gather_backend_options(given)  # --trainer.backend_options.NAME: the chosen backend's own options
    for name in specs:
        if name not in SPEC_SECTIONS:
            errors.append(
                f"section {name!r} names a class (class_path), which only the sections {', '.join(SPEC_SECTIONS)} may; "
                f"the others take fields{_own_section_hint(name, classes)}"
            )
    errors += [error for name, spec in specs.items() if name in SPEC_SECTIONS for error in check_class_spec(name, spec)]
    errors += check_handed_sections(specs)
    errors += check_callbacks(callback_specs)
    for index, (key, value, source, from_text) in enumerate(given):
        if key in LIGHTNING_ALIASES:
            logger.warning("%s (from %s) is Lightning's name; read as %s", key, source, LIGHTNING_ALIASES[key])
            key = LIGHTNING_ALIASES[key]
            given[index] = (key, value, source, from_text)
        try:
            _assign(values, fields, key, value, source=source, from_text=from_text)
        except ConfigError as error:
            errors.append(str(error))
    backend_source = next((source for key, _, source, _ in reversed(given) if key == "trainer.backend"), None)
    if backend_source is not None and "backend" in values["trainer"]:
        errors.extend(_unknown_backend(values["trainer"]["backend"], backend_source))
    built = {}
    for name, cls in classes.items():
        try:
            built[name] = cls(**values[name])
        except (TypeError, ValueError) as error:
            errors.extend(_every_field_error(name, cls, values[name], error))
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else f"{len(errors)} config errors:\n  " + "\n  ".join(errors))
    trainer = built["trainer"]
    trainer.checkpointer_args = built["checkpointer"]
    config = RunConfig(built)
    config.class_specs = specs
    config.callback_specs = [dict(spec) for spec in callback_specs]
    trainer.run_config = config  # lets the trainer save every section
    return config


def _every_field_error(name: str, cls: Type, values: Dict[str, Any], error: Exception) -> List[str]:
    """The checks ``cls(**values)`` failed, one per field (each field tried alone), else ``error`` itself."""
    found = []
    for field, value in values.items():
        try:
            cls(**{field: value})
        except (TypeError, ValueError) as alone:
            found.append(f"section {name!r}: {alone}")
    return found or [f"section {name!r}: {error}"]


def _unknown_backend(name: Any, source: str) -> List[str]:
    """The error for a backend name no backend is registered under (with the closest name), or none."""
    from backends import available_backends

    known = available_backends()
    if not isinstance(name, str) or name in known:
        return []
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    shown = bounded_repr(name)
    return [f"trainer.backend={shown} (from {source}): unknown backend; {hint}available backends: {', '.join(known)}"]


def _split_arguments(argv: List[str]) -> Tuple[Optional[str], List[Tuple[str, Any]]]:
    config_path: Optional[str] = None
    overrides: List[Tuple[str, Any]] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if not item.startswith("--") or item == "--":
            raise ConfigError(f"unexpected argument {item!r}; use --config FILE or --section.field VALUE")
        key, has_value, given = item[2:].partition("=")
        value: Any = given
        if not has_value:
            if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                value = argv[index + 1]
                index += 1
            else:
                value = _NO_VALUE
        index += 1
        if key == "config":
            if value is _NO_VALUE:
                raise ConfigError("--config needs a file name")
            config_path = value
        else:
            overrides.append((SHORTCUTS.get(key, key), value))
    return config_path, overrides


def _load_yaml(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist" + (" (it is a directory)" if os.path.isdir(path) else ""))
    try:
        data = load_yaml(run_files.read_text(run_files.named_by_user(path), run_files.CONFIG))
    except (run_files.UnsafeRunFile, YamlRefused) as error:
        verdict = "is" if str(error).startswith("not valid YAML") else "refused:"
        raise ConfigError(f"config file {path!r} {verdict} {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _names_class(name: str, value: Any) -> bool:
    """True for a top-level section given as ``class_path`` / ``init_args`` (or meant as one)."""
    return isinstance(value, Mapping) and (
        "class_path" in value or (name in (*HANDED_TO_MODEL, "model") and "init_args" in value)
    )


def _own_section_hint(name: str, classes: Mapping[str, Type]) -> str:
    return f" (the {name!r} section is the program's own: give its fields)" if name in classes else ""


def _flatten(data: Mapping[str, Any], source: str, errors: Optional[List[str]] = None) -> Dict[str, Any]:
    """``{section: {field: value}}`` (and top-level shortcuts) as ``{"section.field": value}``."""
    flat = {}
    for key, value in data.items():
        key = str(key)
        if key in (RUN_ID_KEY, "hyper_parameters"):
            continue  # the id of the run that saved this config.yaml, the module's saved hparams: not settings
        if key in SHORTCUTS:
            flat[SHORTCUTS[key]] = value
        elif key in LIGHTNING_TOP_LEVEL and errors is not None:
            errors.append(f"{key!r} (from {source}) is LightningCLI's top-level key; here it is {LIGHTNING_TOP_LEVEL[key]}")
        elif value is None or _names_class(key, value):
            continue  # an empty section, or a class_path one (framework/config/class_path.py)
        elif isinstance(value, Mapping):
            for name, item in value.items():
                flat[f"{key}.{name}"] = item
        else:
            flat[key] = value  # reported as an unknown key with a suggestion
    return flat


def _field_index(classes: Mapping[str, Type]) -> Dict[str, Tuple[str, str, Any]]:
    """``{"section.field": (section, field, type hint)}`` for every settable field."""
    index = {}
    for section, cls in classes.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) not in _HIDDEN_FIELDS and f.init:
                index[f"{section}.{f.name}"] = (section, f.name, hints.get(f.name, Any))
    return index


def suggest(key: str, valid: Sequence[str]) -> Optional[str]:
    """The valid key closest to ``key``: the same field name in another section, else the
    closest field name within the section (or the closest section), else None.

    Example:
        >>> suggest("trainer.save_dir", ["trainer.epochs", "checkpointer.save_dir"])
        'checkpointer.save_dir'
        >>> suggest("trainer.epoch", ["trainer.epochs", "checkpointer.save_dir"])
        'trainer.epochs'
    """
    section, _, name = key.rpartition(".")
    fields_of: Dict[str, List[str]] = {}
    for candidate in valid:
        candidate_section, _, candidate_name = candidate.rpartition(".")
        fields_of.setdefault(candidate_section, []).append(candidate_name)
        if candidate_name == name:
            return candidate
    if section in fields_of:
        sections = [section]
    elif section:
        sections = difflib.get_close_matches(section, list(fields_of), n=1, cutoff=0.6)
    else:
        sections = list(fields_of)
    scored = [
        (
            1.0 if name and candidate.startswith(name) else difflib.SequenceMatcher(None, name, candidate).ratio(),
            -len(candidate),  # ties: the shortest
            f"{candidate_section}.{candidate}",
        )
        for candidate_section in sections
        for candidate in fields_of[candidate_section]
    ]
    best = max(scored, default=(0.0, 0, None))
    return best[2] if best[0] >= 0.7 else None


def _assign(
    values: Dict[str, Dict[str, Any]], fields: Dict[str, Tuple[str, str, Any]], key: str, value: Any, source: str, from_text: bool
) -> None:
    if key in LIGHTNING_HINTS:
        raise ConfigError(f"{key} (from {source}) is a Lightning setting; here it is {LIGHTNING_HINTS[key]}")
    if key not in fields:
        close = suggest(key, list(fields))
        hint = f"; did you mean {close!r}?" if close else f"; valid sections: {sorted({f[0] for f in fields.values()})}"
        raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
    section, name, hint = fields[key]
    if value is _NO_VALUE:
        if hint is not bool:
            raise ConfigError(f"--{key} needs a value ({type_name(hint)})")
        value = "true"
    try:
        values[section][name] = convert(value, hint, from_text)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key}={bounded_repr(value)} (from {source}): {error}") from None
