"""Loggers by name: the built-in ones, registered ones and the entry-point group ``framework.loggers``."""

import logging
import os
from typing import Any, Callable, Dict, List, Protocol, Sequence

from backends.plugins import register_entry_points
from framework.loggers.base import Logger


class LoggerArguments(Protocol):
    """What the logger registry reads of the run's ``TrainerArguments``."""

    @property
    def output_dir(self) -> str: ...
    @property
    def loggers(self) -> Sequence[Any]: ...
    @property
    def tensorboard(self) -> bool: ...


logger = logging.getLogger("framework")

ENTRY_POINT_GROUP = "framework.loggers"
LoggerFactory = Callable[[LoggerArguments], Logger]


def _csv(args: LoggerArguments) -> Logger:
    from framework.loggers.csv_logger import CSVLogger

    return CSVLogger(os.path.join(args.output_dir, "metrics.csv"))


def _tensorboard(args: LoggerArguments) -> Logger:
    from framework.loggers.tensorboard_logger import TensorBoardLogger

    return TensorBoardLogger(os.path.join(args.output_dir, "tensorboard"))


def _mlflow(args: LoggerArguments) -> Logger:
    from framework.loggers.mlflow_logger import MLflowLogger

    return MLflowLogger()


def _wandb(args: LoggerArguments) -> Logger:
    from framework.loggers.wandb_logger import WandbLogger

    return WandbLogger()


_registry: Dict[str, LoggerFactory] = {"csv": _csv, "tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}
_entry_points_loaded = False


def register_logger(name: str, factory: LoggerFactory, override: bool = False) -> None:
    """Make ``name`` usable in ``TrainerArguments.loggers``: ``factory(args)`` builds the logger.

    Packages can declare the same in the entry-point group ``framework.loggers``
    (``my_tracker = my_package.logging:build_logger``).

    Raises:
        ValueError: the name is empty or taken (without ``override=True``).
        TypeError: ``factory`` is not callable.

    Example:
        >>> register_logger("nothing", lambda args: Logger(), override=True)
        >>> "nothing" in available_loggers()
        True
        >>> unregister_logger("nothing")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"logger name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"logger {name!r}: the factory must be callable (TrainerArguments -> Logger), got {factory!r}")
    if name in _registry and not override and _registry[name] is not factory:
        raise ValueError(f"logger {name!r} is already registered; pass override=True to replace it")
    _registry[name] = factory


def unregister_logger(name: str) -> None:
    """Forget the logger ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.
    """
    if name not in _registry:
        raise ValueError(f"logger {name!r} is not registered; registered: {', '.join(available_loggers())}")
    del _registry[name]


def available_loggers() -> List[str]:
    """Every usable logger name (built-in, registered, and from entry points).

    Example:
        >>> available_loggers()[:4]
        ['csv', 'tensorboard', 'mlflow', 'wandb']
    """
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        register_entry_points(ENTRY_POINT_GROUP, _registry, register_logger, "logger", logger)
    return list(_registry)


def check_logger_choices(choices: Sequence[Any]) -> None:
    """Refuse anything in ``TrainerArguments.loggers`` but known names and :class:`Logger` instances.

    Raises:
        ValueError: an unknown or repeated name (the known ones are listed).
        TypeError: an item that is neither a string nor a Logger.

    Example:
        >>> check_logger_choices(["csv", "tensorbord"])
        Traceback (most recent call last):
        ...
        ValueError: TrainerArguments.loggers: unknown logger 'tensorbord'; known: csv, tensorboard, mlflow, wandb
    """
    names = [choice for choice in choices if isinstance(choice, str)]
    for choice in choices:
        if not isinstance(choice, (str, Logger)):
            raise TypeError(
                f"TrainerArguments.loggers: {choice!r} ({type(choice).__name__}) is invalid; allowed: a logger name "
                "or a framework.loggers.Logger instance"
            )
        if isinstance(choice, str) and choice not in _registry and choice not in available_loggers():  # plugins: on a miss
            raise ValueError(f"TrainerArguments.loggers: unknown logger {choice!r}; known: {', '.join(available_loggers())}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"TrainerArguments.loggers names {', '.join(map(repr, repeated))} more than once; list each once")


def build_loggers(args: LoggerArguments) -> List[Logger]:
    """The loggers ``args.loggers`` names (instances as given), plus ``tensorboard`` for ``tensorboard=True``."""
    choices = list(args.loggers)
    if args.tensorboard and "tensorboard" not in choices:
        choices.append("tensorboard")
    check_logger_choices(choices)
    return [choice if isinstance(choice, Logger) else _registry[choice](args) for choice in choices]
