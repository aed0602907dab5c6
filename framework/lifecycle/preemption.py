"""Preemption: a termination signal becomes a checkpoint at the next step boundary and a clean exit."""

import logging
import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend

logger = logging.getLogger("framework")

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by a signal after saving (``EX_TEMPFAIL``: run it again to resume)."""


class TrainingPreempted(SystemExit):
    """Raised by ``Trainer.train()`` after a signal: the checkpoint of the stop step is saved.

    A ``SystemExit``, so an uncaught one ends the script quietly with
    :data:`PREEMPTED_EXIT_CODE`; catch it to do something else.

    Attributes:
        signal_name: the signal that asked for the stop (``"SIGTERM"``...).
        global_step: the step the checkpoint was taken at.
    """

    def __init__(self, signal_name: str, global_step: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name = signal_name
        self.global_step = global_step

    def __str__(self) -> str:
        return f"stopped by {self.signal_name} at global step {self.global_step} (checkpoint saved)"


def parse_signals(names: str) -> List[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` (or ``"TERM, USR1"``) as signals; ``""`` is none.

    Raises:
        ValueError: a name that is not a signal of this platform, naming it and the allowed ones.

    Example:
        >>> [s.name for s in parse_signals("SIGTERM, USR1")]
        ['SIGTERM', 'SIGUSR1']
    """
    signals = []
    for name in (part.strip().upper() for part in names.split(",")):
        if not name:
            continue
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
            allowed = ", ".join(sorted(s for s in signal.Signals.__members__ if s not in ("SIGKILL", "SIGSTOP")))
            raise ValueError(f"preemption_signals: {name!r} is not a signal that can be caught here; allowed: {allowed}")
        signals.append(signal.Signals[full])
    return signals


class PreemptionHandler:
    """While active, the listed signals set :attr:`requested` instead of killing the process.

    The trainer checks the flag at every optimizer-step boundary (a Python attribute read),
    saves a checkpoint there and raises :class:`TrainingPreempted`. A second signal restores
    the previous handler and re-delivers itself: the process ends at once.

    Args:
        signals: the signals to catch.

    Example:
        >>> handler = PreemptionHandler(parse_signals("SIGUSR1"))
        >>> with handler:
        ...     os.kill(os.getpid(), signal.SIGUSR1)
        ...     handler.requested, handler.signal_name
        (True, 'SIGUSR1')
    """

    def __init__(self, signals: List[signal.Signals]) -> None:
        self.signals = list(signals)
        self.requested = False
        self.signal_name: Optional[str] = None
        self._signalled = False  # a caught signal arrived (a second one ends the process at once)
        self._previous: Dict[signal.Signals, Any] = {}

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not on the main thread: preemption signals are not caught")
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def expect_termination(self) -> None:
        """From now on ignore the caught signals: the run has saved and is ending (a scheduler
        that requeues the job signals it again)."""
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)

    def request(self, reason: str) -> None:
        """Ask for the same stop as a signal, for ``reason`` (e.g. the launcher is gone; see
        framework/lifecycle/launcher_watch.py). Safe from any thread; a later signal still counts as the first."""
        if not self.requested:
            self.signal_name = reason
        self.requested = True

    def stop(self, step: int, backend: "TrainerBackend", save: Callable[[], None]) -> NoReturn:
        """Leave training at ``step`` after a stop request: ``save`` (it waits for the write), requeue
        the job where the scheduler allows it (Slurm ``--requeue``), raise :class:`TrainingPreempted`
        (exit status 75). Collective: every rank stops at the same step."""
        signal_name = self.signal_name or "a signal on another rank"
        logger.warning("%s received: saving a checkpoint at step %d and exiting", signal_name, step)
        save()
        self.expect_termination()  # a requeue ends every process of the job with SIGTERM
        backend.barrier()  # every rank has saved before the job is requeued
        environment = backend.cluster_environment
        if backend.is_main_process and environment.requeues and environment.requeue():
            logger.warning("requeued the job: it continues from this checkpoint when it starts again")
        raise TrainingPreempted(signal_name, step)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._signalled:  # the second signal: stop waiting for the step to finish
            signal.signal(signum, self._previous.get(signal.Signals(signum), signal.SIG_DFL))
            self._previous.pop(signal.Signals(signum), None)
            os.kill(os.getpid(), signum)
            return
        self._signalled = True
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True
