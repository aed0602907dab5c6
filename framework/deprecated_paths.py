"""Module paths of framework/ that earlier docs showed and that moved: each still imports (and
runs with ``python -m``), with a ``FutureWarning`` naming the new path.

The machinery (one finder for framework/ and backends/) lives in :mod:`backends.moved_modules`;
this module adds framework's paths to its table. ``import framework.run.config`` gives the very
module ``framework.config.cli``; ``python -m framework.plot`` runs ``framework.metrics.plot``.
``framework.config`` itself became a package (the config concern): its ``__init__`` forwards the
names the old module exported, with the same warning.

Example:
    >>> MOVED_MODULES["framework.rng"]
    'framework.data.rng'
"""

from backends.moved_modules import MOVED_MODULES, MovedModuleFinder, install, warn_moved

MOVED_MODULES.update(
    {
        "framework.rng": "framework.data.rng",
        "framework.prediction": "framework.evaluation.prediction",
        "framework.plot": "framework.metrics.plot",
        "framework.run_lock": "framework.run.run_lock",
        "framework.run_identity": "framework.run.run_identity",
        "framework.run_directory": "framework.run.run_directory",
        "framework.loop.trainer_setup": "framework.loop.training_setup",
        "framework.loop.trainer_checkpoints": "framework.loop.checkpoint_manager",
        "framework.run.run_start": "framework.loop.run_start",
        "framework.run.arguments": "framework.config.arguments",
        "framework.run.typed_fields": "framework.config.typed_fields",
        "framework.run.bounded_yaml": "framework.config.bounded_yaml",
        "framework.run.bounded_repr": "framework.config.bounded_repr",
        "framework.run.yaml_text": "framework.config.yaml_text",
        "framework.run.config": "framework.config.cli",
        "framework.run.class_path": "framework.config.class_path",
        "framework.run.config_help": "framework.config.help",
        "framework.run.config_convert": "framework.config.conversion",
        "framework.run.hyperparameters": "framework.config.hyperparameters",
        "framework.run.lightning_names": "framework.config.lightning_names",
        "framework.run.backend_options_config": "framework.config.backend_options",
        "framework.run.preemption": "framework.lifecycle.preemption",
        "framework.run.launcher_watch": "framework.lifecycle.launcher_watch",
        "framework.run.logging_setup": "framework.lifecycle.logging_setup",
        "framework.run.checks": "framework.loop.module_checks",
    }
)

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install", "warn_moved"]
