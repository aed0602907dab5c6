"""Orphaned workers stop: a process whose launcher died saves a checkpoint and exits, as on SIGTERM.

``torchrun`` killed with SIGKILL (an OOM killer, a lost node agent) leaves its workers
running, unsupervised, writing checkpoints that a restarted launcher's workers then race.
While training runs, a daemon thread checks every :data:`POLL_SECONDS` whether this
process's parent (the launcher, when the cluster environment says it is:
``ClusterEnvironment.parent_is_launcher``) is still its parent. When it is gone, the thread
asks the :class:`~framework.lifecycle.preemption.PreemptionHandler` for a stop: the run saves at the
next step boundary the ranks agree on and exits with status 75, naming the lost launcher.
Nothing runs in the training loop (the loop already reads the handler's flag).

Without its launcher the ranks can no longer agree through the launcher's store; the DDP
strategy then agrees at the next log point, over the process group (see
``DDP.preemption_agreed``). If even that fails, the error names the lost launcher
(:meth:`LauncherWatch.explain`).
"""

import logging
import os
import threading
from typing import Any, Optional

from framework.lifecycle.preemption import PreemptionHandler

logger = logging.getLogger("framework")

POLL_SECONDS = 0.5
"""How often the watch thread compares ``os.getppid()`` with the launcher's pid."""


class LauncherWatch:
    """While active (``with watch:``), stop the run when this process's launcher dies.

    Args:
        handler: the trainer's preemption handler, asked for the stop.
        launcher: the launcher's name, for messages (``"torchrun"``).
        enabled: False does nothing (a process without a supervising launcher: its parent
            may end legitimately, e.g. a shell that started it in the background).
        poll_seconds: how often the parent is checked.

    Example:
        >>> handler = PreemptionHandler([])
        >>> with LauncherWatch(handler=handler, launcher="torchrun", enabled=True) as watch:
        ...     watch.lost
        False
    """

    def __init__(self, *, handler: PreemptionHandler, launcher: str, enabled: bool, poll_seconds: float = POLL_SECONDS) -> None:
        self.handler = handler
        self.launcher = launcher
        self.enabled = enabled
        self.poll_seconds = poll_seconds
        self.launcher_pid: Optional[int] = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "LauncherWatch":
        parent = os.getppid()
        if not self.enabled or parent == 1:  # already orphaned or started by init: nothing to watch
            return self
        self.launcher_pid = parent
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            if os.getppid() != self.launcher_pid:
                self.lost = True
                reason = f"the loss of its launcher ({self.launcher}, pid {self.launcher_pid}, is gone)"
                logger.warning("%s: stopping at the next step boundary with a checkpoint", reason)
                self.handler.request(reason)
                return

    def explain(self, error: BaseException) -> Optional[str]:
        """After the launcher was lost, what ``error`` (e.g. ``DistNetworkError: Broken pipe``) means; else None."""
        if not self.lost:
            return None
        return (
            f"this worker's launcher ({self.launcher}, pid {self.launcher_pid}) died, and the ranks could not agree on a "
            f"stop checkpoint without it (the newest checkpoint on disk is the one to resume from); "
            f"start the job again to resume. The error was: {type(error).__name__}: {str(error).strip()[:300]}"
        )
