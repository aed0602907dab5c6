"""A single background thread that runs one save at a time."""

import threading
from typing import Callable, Optional


class BackgroundWriter:
    """Runs write jobs on a background thread, at most one in flight.

    Submitting waits for the previous job; an error raised by a job is re-raised by the
    next :meth:`submit` or by :meth:`wait`, so no failure goes unnoticed.

    Example:
        >>> writer = BackgroundWriter()
        >>> writer.submit(lambda: None)
        >>> writer.wait()
    """

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, job: Callable[[], None]) -> None:
        """Wait for the job in flight, then start ``job`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
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
