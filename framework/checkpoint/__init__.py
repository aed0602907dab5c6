"""Checkpoints: the bundle, the checkpointer interface, the default fsspec checkpointer, and
loading a run's weights for inference (``load_weights``)."""

from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.default import DefaultCheckpointer
from framework.checkpoint.storage import CheckpointRefused, CheckpointWriteError, CorruptCheckpoint
from framework.checkpoint.weights import load_weights
from framework.run.run_directory import RunDirectoryInUse

__all__ = [
    "AbstractCheckpointer",
    "Checkpoint",
    "CheckpointRefused",
    "CheckpointWriteError",
    "CorruptCheckpoint",
    "DefaultCheckpointer",
    "DefaultCheckpointerArguments",
    "RunDirectoryInUse",
    "load_weights",
]
