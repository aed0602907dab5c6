"""Callbacks: hook objects run after the module's own hooks, in list order.

Example:
    >>> from framework.callbacks import EarlyStopping, LearningRateMonitor
    >>> callbacks = [EarlyStopping(monitor="val_loss", patience=3), LearningRateMonitor()]
"""

from framework.callbacks.base import Callback, StopTraining
from framework.callbacks.early_stopping import EarlyStopping
from framework.callbacks.ema import EMA
from framework.callbacks.lr_monitor import LearningRateMonitor
from framework.callbacks.metrics_plot import MetricsPlot
from framework.callbacks.model_summary import ModelSummary
from framework.callbacks.profiler import TorchProfiler
from framework.callbacks.progress import ProgressBar
from framework.callbacks.swa import SWA
from framework.callbacks.terminate_on_nan import TerminateOnNaN
from framework.callbacks.throughput import Throughput
from framework.callbacks.timer import Timer
from framework.callbacks.weight_averaging import WeightAveraging

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
