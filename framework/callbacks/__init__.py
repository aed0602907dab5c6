"""Callbacks: hook objects run after the module's own hooks, in list order."""

from framework.callbacks.base import Callback, StopTraining
from framework.callbacks.progress import ProgressBar

__all__ = ["Callback", "StopTraining", "ProgressBar"]
