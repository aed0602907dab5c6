"""Checkpoints: the bundle, the checkpointer interface and the default fsspec checkpointer."""

from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.default import DefaultCheckpointer
from framework.checkpoint.storage import CheckpointRefused, CheckpointWriteError, CorruptCheckpoint
from framework.run_directory import RunDirectoryInUse

__all__ = [
    "AbstractCheckpointer",
    "Checkpoint",
    "CheckpointRefused",
    "CheckpointWriteError",
    "CorruptCheckpoint",
    "DefaultCheckpointer",
    "DefaultCheckpointerArguments",
    "RunDirectoryInUse",
]
