"""Loggers: where recorded metric values go on rank zero (CSV, TensorBoard, MLflow, W&B, plugins).

Chosen by name in ``TrainerArguments.loggers`` (default ``["csv"]``); see ``docs/metrics.md``.
"""

from framework.loggers.base import FAILED, FINISHED, KILLED, Logger, Record, RunInfo
from framework.loggers.collection import LoggerSet, LoggerStartFailed, run_status
from framework.loggers.csv_logger import CSVLogger
from framework.loggers.registry import (
    ENTRY_POINT_GROUP,
    available_loggers,
    build_loggers,
    check_logger_choices,
    register_logger,
    unregister_logger,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "FAILED",
    "FINISHED",
    "KILLED",
    "CSVLogger",
    "Logger",
    "LoggerSet",
    "LoggerStartFailed",
    "Record",
    "RunInfo",
    "available_loggers",
    "build_loggers",
    "check_logger_choices",
    "register_logger",
    "run_status",
    "unregister_logger",
]
