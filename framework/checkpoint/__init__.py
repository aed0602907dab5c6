"""Checkpoints: the bundle, the checkpointer interface and the default fsspec checkpointer."""

from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.default import DefaultCheckpointer
from framework.checkpoint.sharded import ShardedCheckpointer

__all__ = ["AbstractCheckpointer", "Checkpoint", "DefaultCheckpointer", "DefaultCheckpointerArguments", "ShardedCheckpointer"]
