"""A small, fast, correct Lightning-style trainer for PyTorch.

Example:
    >>> from framework import ModuleInterface, Trainer, TrainerArguments, Stage, seed_everything
"""

from framework.arguments import TrainerArguments
from framework.module import ModuleInterface
from framework.rng import seed_everything
from framework.stage import Stage
from framework.trainer import Trainer

__all__ = ["ModuleInterface", "Trainer", "TrainerArguments", "Stage", "seed_everything"]
__version__ = "0.1.0"
