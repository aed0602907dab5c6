"""Module paths of framework/ that earlier docs showed and that moved: each still imports (and
runs with ``python -m``), with a ``FutureWarning`` naming the new path.

The machinery (one finder for framework/ and backends/) lives in :mod:`backends.moved_modules`;
this module adds framework's paths to its table. ``import framework.config`` gives the very
module ``framework.run.config``; ``python -m framework.plot`` runs ``framework.metrics.plot``.

Example:
    >>> MOVED_MODULES["framework.rng"]
    'framework.data.rng'
"""

from backends.moved_modules import MOVED_MODULES, MovedModuleFinder, install, warn_moved

MOVED_MODULES.update(
    {
        "framework.config": "framework.run.config",
        "framework.rng": "framework.data.rng",
        "framework.prediction": "framework.evaluation.prediction",
        "framework.plot": "framework.metrics.plot",
        "framework.run_lock": "framework.run.run_lock",
        "framework.run_identity": "framework.run.run_identity",
        "framework.run_directory": "framework.run.run_directory",
        "framework.loop.trainer_setup": "framework.loop.training_setup",
        "framework.loop.trainer_checkpoints": "framework.loop.checkpoint_manager",
        "framework.run.run_start": "framework.loop.run_start",
    }
)

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install", "warn_moved"]
