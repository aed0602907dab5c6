"""Checkpoints: the bundle, the checkpointer interface, the default fsspec checkpointer, and
loading a run's weights for inference (``load_weights``)."""

from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.default import DefaultCheckpointer
from framework.checkpoint.weights import load_weights

__all__ = ["AbstractCheckpointer", "Checkpoint", "DefaultCheckpointer", "DefaultCheckpointerArguments", "load_weights"]
