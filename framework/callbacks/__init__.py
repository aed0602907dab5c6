"""Callbacks: hook objects run after the module's own hooks, in list order.

Example:
    >>> from framework.callbacks import EarlyStopping, LearningRateMonitor
    >>> callbacks = [EarlyStopping(monitor="val_loss", patience=3), LearningRateMonitor()]
"""

import importlib
from typing import Any, List

from framework.callbacks.base import Callback, StopTraining

# Loaded on first use (issue 53): a default run uses none of these, and ``import framework`` need not
# compile and run their modules. ``from framework.callbacks import EarlyStopping`` works as before.
_LAZY = {
    "EarlyStopping": "framework.callbacks.early_stopping",
    "EMA": "framework.callbacks.ema",
    "LearningRateMonitor": "framework.callbacks.lr_monitor",
    "MetricsPlot": "framework.callbacks.metrics_plot",
    "ModelSummary": "framework.callbacks.model_summary",
    "TorchProfiler": "framework.callbacks.profiler",
    "ProgressBar": "framework.callbacks.progress",
    "SWA": "framework.callbacks.swa",
    "TerminateOnNaN": "framework.callbacks.terminate_on_nan",
    "Throughput": "framework.callbacks.throughput",
    "Timer": "framework.callbacks.timer",
    "WeightAveraging": "framework.callbacks.weight_averaging",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework.callbacks' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "EMA",
    "SWA",
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "MetricsPlot",
    "ModelSummary",
    "ProgressBar",
    "StopTraining",
    "TerminateOnNaN",
    "Throughput",
    "Timer",
    "TorchProfiler",
    "WeightAveraging",
]
