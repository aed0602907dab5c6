"""The run's loggers together: started, fed and finished on rank zero, a failing one set aside."""

import contextlib
import logging
from typing import Any, Callable, Dict, List, Set

from framework.loggers.base import FAILED, FINISHED, KILLED, Logger, Record, RunInfo

logger = logging.getLogger("framework")


def run_status(error: BaseException) -> str:
    """How a run that raised ``error`` ended: ``KILLED`` when preempted or interrupted, else ``FAILED``.

    Example:
        >>> run_status(KeyboardInterrupt()), run_status(ValueError())
        ('KILLED', 'FAILED')
    """
    from framework.lifecycle.preemption import TrainingPreempted

    return KILLED if isinstance(error, (TrainingPreempted, KeyboardInterrupt)) else FAILED


class LoggerStartFailed(RuntimeError):
    """A logger the run asked for could not start (a tracker unreachable or refusing the store):
    raised before step 1, naming the logger and the cause.

    Example:
        >>> raise LoggerStartFailed("logger 'mlflow' could not start (MlflowException: ...)")
        Traceback (most recent call last):
        ...
        framework.loggers.collection.LoggerStartFailed: logger 'mlflow' could not start (MlflowException: ...)
    """


class LoggerSet:
    """Calls each :class:`Logger` in turn, only where ``active`` (rank zero).

    A logger that cannot start is an error (:class:`LoggerStartFailed`, before step 1): the
    user asked for it. One that raises later (tracker down, disk full) is named in one warning
    and skipped for the rest of the run: training, and the checkpoints it writes, go on.

    Args:
        loggers: the loggers, in the order they are called.
        active: False on the ranks that do not log (every rank keeps the loggers' state).

    Example:
        loggers = LoggerSet(build_loggers(args), active=trainer.is_main_process)
        loggers.start(lambda: RunInfo(output_dir="outputs"))
        loggers.log([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        loggers.finish(FINISHED)
    """

    def __init__(self, loggers: List[Logger], active: bool) -> None:
        self.loggers = loggers
        self.active = active
        self.started = False
        self._failed: Set[int] = set()

    def _keys(self) -> List[str]:
        keys: List[str] = []
        for item in self.loggers:
            key = item.name or type(item).__name__
            keys.append(key if key not in keys else f"{key}#{len(keys)}")
        return keys

    def state_dict(self) -> Dict[str, Dict[str, Any]]:
        """Each logger's state by name (e.g. a tracker's run id), for the checkpoint."""
        return {key: item.state_dict() for key, item in zip(self._keys(), self.loggers)}

    def load_state_dict(self, state: Dict[str, Dict[str, Any]]) -> None:
        """Hand each logger its saved state (loggers not in ``state`` start afresh)."""
        for key, item in zip(self._keys(), self.loggers):
            if key in state:
                item.load_state_dict(state[key])

    def start(self, run: Callable[[], RunInfo]) -> None:
        """Start every logger, unless started or inactive (``run`` is built only when needed)."""
        if self.started or not self.active or not self.loggers:
            return
        self.started = True
        info = run()
        for index, item in enumerate(self.loggers):
            if index in self._failed:
                continue
            try:
                item.start(info)
            except Exception as error:
                self.started = False
                for earlier in self.loggers[:index]:  # those already started end as failed runs
                    with contextlib.suppress(Exception):  # the start failure is the one to report
                        earlier.finish(FAILED)
                raise LoggerStartFailed(
                    f"logger {item.name or type(item).__name__!r} could not start ({type(error).__name__}: {error}); "
                    "nothing was trained: fix it, or leave it out of TrainerArguments.loggers (--trainer.loggers)"
                ) from error

    def log(self, records: List[Record]) -> None:
        """Hand newly recorded values to every started logger."""
        if self.started:
            self._each("log_metrics", lambda item: item.log_metrics(records))

    def finish(self, status: str = FINISHED) -> None:
        """End the call (``FINISHED``, ``FAILED`` or ``KILLED``); a later :meth:`start` starts them again."""
        if self.started:
            self.started = False
            self._each("finish", lambda item: item.finish(status))

    def _each(self, what: str, call: Callable[[Logger], None]) -> None:
        for index, item in enumerate(self.loggers):
            if index in self._failed:
                continue
            try:
                call(item)
            except Exception as error:  # a tracker must never stop training
                self._failed.add(index)
                logger.warning(
                    "logger %r failed in %s (%s: %s); it is skipped for the rest of this run, training goes on",
                    item.name or type(item).__name__,
                    what,
                    type(error).__name__,
                    error,
                )
