"""A single background thread that runs one save at a time."""

import logging
import os
import sys
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs write jobs on a background thread, at most one in flight.

    Submitting waits for the previous job; an error raised by a job is re-raised by the
    next :meth:`submit` or by :meth:`wait`, so no failure goes unnoticed. The thread is not
    a daemon: a job in flight when the program ends still completes.

    On Linux the writer thread lowers its own scheduling priority (``nice``), so when
    training keeps every core busy the write uses the cycles training leaves idle instead
    of slowing the training threads down.

    Args:
        niceness: how much to lower the writer thread's priority (0: not at all; Linux only).

    Example:
        >>> writer = BackgroundWriter()
        >>> writer.submit(lambda: None)
        >>> writer.wait()
    """

    def __init__(self, niceness: int = 10) -> None:
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness={niceness} is invalid; allowed: 0 to 19")
        self.niceness = niceness
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    @property
    def busy(self) -> bool:
        """True while a job runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        """Wait for the job in flight (re-raising its error), then start ``job`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        if self.niceness and sys.platform.startswith("linux"):
            try:  # on Linux a thread has its own id and niceness; raising niceness needs no privilege
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
            except OSError as error:
                logger.debug("could not lower the checkpoint writer's priority: %s", error)
        try:
            job()
        except BaseException as error:  # surfaced on the training thread by wait()
            self._error = error

    def wait(self) -> None:
        """Block until the job in flight ends; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint save failed: {error}") from error
