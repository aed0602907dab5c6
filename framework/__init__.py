"""A small, fast, correct Lightning-style trainer for PyTorch.

Example:
    >>> from framework import ModuleInterface, Trainer, TrainerArguments, Stage
"""

from framework.arguments import TrainerArguments
from framework.loss_tracker import TrainingDiverged
from framework.module import ModuleInterface
from framework.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from framework.rng import seed_everything
from framework.sample_randomness import sample_generator, sample_seed
from framework.stage import Stage
from framework.trainer import Trainer

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "ModuleInterface",
    "Stage",
    "Trainer",
    "TrainerArguments",
    "TrainingDiverged",
    "TrainingPreempted",
    "sample_generator",
    "sample_seed",
    "seed_everything",
]
__version__ = "0.1.0"
