"""Module paths that moved: each still imports (and runs with ``python -m``), with a
``FutureWarning`` naming the new path.

``import backends.ddp`` gives the very module ``backends.strategies.ddp`` (one module object,
so patching either name patches both). A moved path is listed here once and never removed
(tests/test_public_api.py checks that every old path imports). framework/ adds its own moved
paths to the same table (``framework.deprecated_paths``).

Example:
    >>> MOVED_MODULES["backends.ddp"]
    'backends.strategies.ddp'
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Optional, Sequence

# old module path -> where it lives now (framework/deprecated_paths.py adds framework's own)
MOVED_MODULES = {
    "backends.activation_checkpointing": "backends.strategies.activation_checkpointing",
    "backends.buffers": "backends.strategies.buffers",
    "backends.ddp": "backends.strategies.ddp",
    "backends.fsdp": "backends.strategies.fsdp",
    "backends.model_parallel": "backends.strategies.model_parallel",
    "backends.units": "backends.strategies.units",
    "backends.gradient_clipping": "backends.strategies.gradient_clipping",
    "backends.meta_init": "backends.strategies.meta_init",
    "backends.cluster_environment": "backends.environments.cluster_environment",
    "backends.slurm": "backends.environments.slurm",
    "backends.mpi": "backends.environments.mpi",
    "backends.hostlist": "backends.environments.hostlist",
    "backends.sharded_checkpoint": "backends.checkpoint_io.sharded_checkpoint",
    "backends.dcp_index": "backends.checkpoint_io.dcp_index",
    "backends.dcp_reader": "backends.checkpoint_io.dcp_reader",
    "backends.local_files": "backends.checkpoint_io.local_files",
    "backends.stateful": "backends.checkpoint_io.stateful",
    "backends.samplers": "backends.data.samplers",
    "backends.streams": "backends.data.streams",
    "backends.batch": "backends.data.batch",
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
    """Finds the old module paths of :data:`MOVED_MODULES` (installed by ``import backends``)."""

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
