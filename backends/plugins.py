"""Loading plugins that packages declare as entry points (backends, cluster environments)."""

import logging
from importlib import metadata
from typing import Any, Callable, Dict


def register_entry_points(
    group: str, registry: Dict[str, Any], register: Callable[[str, Any], Any], kind: str, log: logging.Logger
) -> None:
    """Register every entry point of ``group`` with ``register(name, loaded)``.

    A name already in ``registry`` is kept (a warning on ``log`` names the plugin, unless it is
    the same object); a plugin that fails to load is reported and skipped, so it never hides
    the others.

    Example:
        >>> register_entry_points("framework.no-such-group", {}, lambda name, value: None, "example", logging.getLogger())
    """
    for entry_point in metadata.entry_points(group=group):
        if entry_point.name in registry:
            try:
                same = registry[entry_point.name] is entry_point.load()
            except Exception:
                same = False
            if not same:
                log.warning(
                    "%s plugin %r (%s) ignored: the name is already registered; pick another name",
                    kind,
                    entry_point.name,
                    entry_point.value,
                )
            continue
        try:
            register(entry_point.name, entry_point.load())
        except Exception as error:  # a broken plugin must not hide the others
            log.warning("%s plugin %r (%s) failed to load: %s", kind, entry_point.name, entry_point.value, error)
