"""A backend's own options in a run's config: ``--trainer.backend_options.NAME VALUE`` (also
``--backend_options.NAME VALUE``), or ``backend_options: {NAME: VALUE}`` under ``trainer:`` (or at
the top) of the YAML, merged (the later value of a name wins) and checked against what the chosen
backend declares (:func:`backends.registry.resolve_backend_options`): every declared option is
then in ``TrainerArguments.backend_options``, at its default unless given, so ``--print_config``
and the saved ``config.yaml`` show the values the run used.
"""

from typing import Any, Dict, List, Tuple

from framework.config.arguments import TrainerArguments
from framework.config.bounded_repr import bounded_repr
from framework.config.bounded_yaml import YamlRefused, load_yaml

FIELD = "trainer.backend_options"
_PREFIXES = ("trainer.backend_options.", "backend_options.")
Given = Tuple[str, Any, str, bool]  # (key, value, source, from_text), as framework/config/cli.py collects them


def gather_backend_options(given: List[Given]) -> List[str]:
    """Replace the backend-option entries of ``given`` with one ``trainer.backend_options`` entry
    holding the chosen backend's resolved options; the errors found, as config error lines.

    An unregistered backend is left to the config's unknown-backend error (its options unchecked).

    Example:
        >>> given = [("trainer.backend", "sp", "the command line", True), ("backend_options.bucket_cap_mb", "50", "cli", True)]
        >>> gather_backend_options(given)
        ["backend_options.bucket_cap_mb=50 does not apply to backend 'sp': it declares no backend_options (from cli)"]
    """
    merged: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    errors: List[str] = []
    kept: List[Given] = []
    for key, value, source, from_text in given:
        name = next((key[len(prefix) :] for prefix in _PREFIXES if key.startswith(prefix)), None)
        if name is not None:
            merged[name] = _value(value, from_text, key, source, errors)
            sources[name] = source
        elif key in (FIELD, "backend_options"):
            mapping = _value(value, from_text, key, source, errors) if from_text else value
            if mapping is None:
                continue
            if not isinstance(mapping, dict):
                errors.append(f"{key}={bounded_repr(value)} (from {source}): expected a mapping of option names to values")
                continue
            merged.update(mapping)
            sources.update(dict.fromkeys(mapping, source))
        else:
            kept.append((key, value, source, from_text))
    from backends.registry import declared_options, resolve_backend_options

    given[:] = kept
    backend = next((value for key, value, _, _ in reversed(kept) if key == "trainer.backend"), TrainerArguments.backend)
    source = ", ".join(dict.fromkeys(sources.values())) or "the backend's defaults"
    try:
        declared = declared_options(backend) if isinstance(backend, str) and not errors else None
    except ValueError:  # an unknown backend: the config reports it
        declared = None
    if declared is None:
        if merged:
            given.append((FIELD, merged, source, False))
        return errors
    if not merged and not declared:
        return []
    try:
        given.append((FIELD, resolve_backend_options(backend, merged), source, False))
    except ValueError as error:
        return [_with_source(line, sources) for line in str(error).splitlines()]
    return []


def _value(value: Any, from_text: bool, key: str, source: str, errors: List[str]) -> Any:
    """A command-line value as YAML reads it (``50`` an int, ``true`` a bool); a flag without one is true."""
    if not from_text:
        return value
    if not isinstance(value, str):
        return True  # --trainer.backend_options.NAME given alone
    try:
        return load_yaml(value)
    except YamlRefused as error:
        errors.append(f"{key}={bounded_repr(value)} (from {source}): {error}")
        return None


def _with_source(line: str, sources: Dict[str, str]) -> str:
    """An error line of :func:`~backends.registry.resolve_backend_options` with where its option was given."""
    name = line.split("=", 1)[0].removeprefix("backend_options.")
    return f"{line} (from {sources[name]})" if name in sources else line
