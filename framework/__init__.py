"""A small, fast, correct Lightning-style trainer for PyTorch.

Example:
    >>> from framework import ModuleInterface, Trainer, TrainerArguments, Stage
"""

import importlib
from typing import Any

from framework import deprecated_paths
from framework.config.arguments import TrainerArguments
from framework.data.data_module import DataModule
from framework.data.rng import seed_everything
from framework.data.sample_randomness import sample_generator, sample_seed
from framework.lifecycle.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from framework.loop.stage import Stage
from framework.loop.trainer import Trainer
from framework.metrics.collector import MetricNotLoggedOnEveryRank
from framework.metrics.loss_tracker import TrainingDiverged
from framework.module import ModuleInterface

deprecated_paths.install()  # framework.config, framework.rng, ...: the paths earlier docs showed

# Loaded on first use: the config parser (yaml), reading predictions back, plotting (matplotlib).
_LAZY = {
    "parse_config": "framework.config.cli",
    "load_predictions": "framework.evaluation.prediction",
    "plot_metrics": "framework.metrics.plot",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework' has no attribute {name!r}")


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "DataModule",
    "MetricNotLoggedOnEveryRank",
    "ModuleInterface",
    "Stage",
    "Trainer",
    "TrainerArguments",
    "TrainingDiverged",
    "TrainingPreempted",
    "load_predictions",
    "parse_config",
    "plot_metrics",
    "sample_generator",
    "sample_seed",
    "seed_everything",
]
__version__ = "0.1.0"
