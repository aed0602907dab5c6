"""Loading plugins that packages declare as entry points (backends, cluster environments)."""

import logging
import re
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

_declared: Optional[List[Tuple[metadata.Distribution, str]]] = None  # (package, its entry_points.txt), read once


def _declaring_packages(rescan: bool) -> List[Tuple[metadata.Distribution, str]]:
    """Every installed package that declares entry points, with the text declaring them."""
    global _declared
    if _declared is None or rescan:
        texts = ((distribution, distribution.read_text("entry_points.txt")) for distribution in metadata.distributions())
        _declared = [(distribution, text) for distribution, text in texts if text]
    return _declared


def installed_entry_points(group: str, rescan: bool = False) -> List[metadata.EntryPoint]:
    """The installed entry points of ``group`` (of two installed copies of a package, the first
    found that declares the group). The installed packages are scanned once per process and
    again with ``rescan=True`` (after installing a package at run time); only the packages that
    name ``group`` are parsed (parsing every package's entry points costs ~100 ms at start-up).

    Example:
        >>> installed_entry_points("framework.no-such-group")
        []
    """
    header = f"[{group}]"
    names: Set[str] = set()
    found: List[metadata.EntryPoint] = []
    for distribution, text in _declaring_packages(rescan):
        if header not in text:
            continue
        name = re.sub(r"[-_.]+", "-", (distribution.metadata["Name"] or "")).lower()
        if name not in names:
            names.add(name)
            found.extend(distribution.entry_points.select(group=group))
    return found


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
