"""Module paths that earlier docs showed and that moved: each still imports (and runs with
``python -m``), with a ``FutureWarning`` naming the new path.

``import framework.config`` gives the very module ``framework.run.config`` (one module object,
so patching either name patches both); ``python -m framework.plot`` runs ``framework.metrics.plot``.
A moved public name is listed here once and never removed (tests/test_public_api.py checks that
every old path imports).

Example:
    >>> MOVED_MODULES["framework.rng"]
    'framework.data.rng'
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Optional, Sequence

# old module path -> where it lives now
MOVED_MODULES = {
    "framework.config": "framework.run.config",
    "framework.rng": "framework.data.rng",
    "framework.prediction": "framework.evaluation.prediction",
    "framework.plot": "framework.metrics.plot",
    "framework.run_lock": "framework.run.run_lock",
    "framework.run_identity": "framework.run.run_identity",
    "framework.run_directory": "framework.run.run_directory",
}


def warn_moved(old: str) -> None:
    """Warn (``FutureWarning``: shown to users by default) that ``old`` moved."""
    warnings.warn(f"{old} is deprecated: import {MOVED_MODULES[old]} instead", FutureWarning, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the new module itself; ``get_code`` serves ``python -m OLD``."""

    def __init__(self, old: str) -> None:
        self.old, self.new = old, MOVED_MODULES[old]

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warn_moved(self.old)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # importlib sets __spec__ to the old path's; put it back in exec_module
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """The new module already ran: only its own ``__spec__`` is put back."""
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> Optional[types.CodeType]:
        warn_moved(self.old)
        spec = importlib.util.find_spec(self.new)
        assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader)
        return spec.loader.get_code(self.new)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED_MODULES` (installed by ``import framework``)."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in MOVED_MODULES:
            return None
        new_spec = importlib.util.find_spec(MOVED_MODULES[fullname])
        origin = new_spec.origin if new_spec is not None else None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname), origin=origin)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
