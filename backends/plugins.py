"""Loading plugins that packages declare as entry points (backends, cluster environments)."""

import logging
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional

_installed: Optional[Any] = None  # every installed entry point, read once per process


def installed_entry_points(group: str, rescan: bool = False) -> List[metadata.EntryPoint]:
    """The installed entry points of ``group``. The installed packages are scanned once per process
    (a scan reads every package's metadata: tens of milliseconds) and again with ``rescan=True``
    (after installing a package at run time).

    Example:
        >>> installed_entry_points("framework.no-such-group")
        []
    """
    global _installed
    installed = _installed if _installed is not None and not rescan else metadata.entry_points()
    _installed = installed
    return list(installed.select(group=group))


def register_entry_points(
    group: str,
    registry: Dict[str, Any],
    register: Callable[[str, Any], Any],
    kind: str,
    log: logging.Logger,
    rescan: bool = False,
) -> None:
    """Register every entry point of ``group`` with ``register(name, loaded)``.

    A name already in ``registry`` is kept (a warning on ``log`` names the plugin, unless it is
    the same object); a plugin that fails to load is reported and skipped, so it never hides
    the others. ``rescan``: read the installed packages again (see :func:`installed_entry_points`).

    Example:
        >>> register_entry_points("framework.no-such-group", {}, lambda name, value: None, "example", logging.getLogger())
    """
    for entry_point in installed_entry_points(group, rescan):
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
