"""One live run per output directory: a lock file held by the running run's rank zero.

``<output_dir>/run.lock`` holds the holder's pid, host, start time and a heartbeat that a
daemon thread refreshes every :data:`HEARTBEAT_SECONDS` (nothing in the training loop).
A second run started on the same directory while the first lives (the same
``resume="auto"`` command submitted twice) is refused before its first step, naming the
holder. A lock whose holder is dead is taken over with a warning: on the same host when
its pid is gone, when the process on that pid started after the lock was taken (the pid was
reused), when it is this very process (a restarted container), or when its heartbeat is older
than :data:`STALE_AFTER_SECONDS`; from another host when its heartbeat is that old. The run
removes its lock when training ends, by an error too; a killed run leaves it, and the next run
takes it over. A run whose ``save_dir`` lies outside ``output_dir`` locks that directory too.
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend

logger = logging.getLogger("framework")

LOCK_NAME = "run.lock"
HEARTBEAT_SECONDS = 10.0
"""How often the holder refreshes the lock's heartbeat."""
STALE_AFTER_SECONDS = 120.0
"""A lock whose heartbeat is older than this is taken over (its run is presumed dead), whatever
process holds its pid now."""
START_TOLERANCE_SECONDS = 2.0
"""A process that started this much later than the lock was taken cannot have taken it (pid reuse)."""


class RunLocked(RuntimeError):
    """Another live run holds the output directory; the message names its pid and host.

    Example:
        >>> raise RunLocked("output_dir 'runs/a' is in use by a live run (pid 4242 on host node1, ...)")
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLocked: output_dir 'runs/a' is in use by a live run (pid 4242 on host node1, ...)
    """


@dataclass
class LockHolder:
    """Who holds a run lock: what ``run.lock`` holds (JSON)."""

    pid: int
    host: str
    started: float
    heartbeat: float

    def describe(self) -> str:
        """``pid 4242 on host node1, started ..., heartbeat 3 s ago`` (for messages)."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {started}, heartbeat {time.time() - self.heartbeat:.0f} s ago"

    def is_same(self, other: Optional["LockHolder"]) -> bool:
        """True when ``other`` is this holder (same process, same start), heartbeat aside."""
        return other is not None and (other.pid, other.host, other.started) == (self.pid, self.host, self.started)

    def is_alive(self, stale_after: float) -> bool:
        """False when the heartbeat is older than ``stale_after``; on this host also when the pid is
        gone (or a zombie) or belongs to a process younger than the lock: a reused pid, or this very
        process restarted with the pid of the run that took it (a container restart)."""
        if time.time() - self.heartbeat > stale_after:
            return False
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's live process
        started = process_start_time(self.pid)
        if started is None:
            return True
        if isinstance(started, str):  # a zombie
            return False
        return started <= self.started + START_TOLERANCE_SECONDS


def process_start_time(pid: int) -> Optional[Union[float, str]]:
    """When the process ``pid`` started (seconds since the epoch), ``"zombie"``, or None when
    ``/proc`` cannot tell (not Linux).

    Example:
        >>> started = process_start_time(os.getpid())
        >>> started is None or time.time() - 3600 < started <= time.time()
        True
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    if fields[0] == "Z":
        return "zombie"
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in clock ticks


class RunLock:
    """The lock on one output directory, taken by :meth:`acquire`, given back by :meth:`release`.

    Args:
        output_dir: the directory to lock (created when missing).
        heartbeat_seconds: how often the background thread refreshes the heartbeat.
        stale_after_seconds: age of a heartbeat after which its lock is taken over.
        what: what the directory is, for messages (``"output_dir"`` or ``"save_dir"``).

    Example:
        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp())
        >>> lock.acquire()
        >>> RunLock(lock.output_dir).acquire()
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLocked: output_dir ... is in use by a live run (pid ...
        >>> lock.release()
    """

    def __init__(
        self,
        output_dir: str,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        stale_after_seconds: float = STALE_AFTER_SECONDS,
        what: str = "output_dir",
    ) -> None:
        self.output_dir = output_dir
        self.what = what
        self.option = "--checkpointer.save_dir" if what == "save_dir" else "--trainer.output_dir"
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_after_seconds = stale_after_seconds
        self.holder: Optional[LockHolder] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lock, or take over a dead holder's, and start the heartbeat.

        Raises:
            RunLocked: a live run holds it (named by pid and host).
        """
        os.makedirs(self.output_dir, exist_ok=True)
        now = time.time()
        mine = LockHolder(os.getpid(), socket.gethostname(), now, now)
        for _ in range(3):
            if self._create(mine):
                self.holder = mine
                self._stop.clear()
                self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
                self._thread.start()
                return
            holder = self._read()
            if holder is not None and holder.is_alive(self.stale_after_seconds):
                raise RunLocked(
                    f"{self.what} {self.output_dir!r} is in use by a live run ({holder.describe()}; lock file "
                    f"{self.path}): two runs in one directory would overwrite each other's checkpoints. Wait for that "
                    f"run to end or stop it; a lock whose heartbeat is older than {self.stale_after_seconds:.0f} s is "
                    f"taken over. To start another run, choose another {self.what} ({self.option})"
                )
            logger.warning(
                "taking over the run lock %s left by a run that is gone (%s)",
                self.path,
                "unreadable lock file" if holder is None else holder.describe(),
            )
            taken = f"{self.path}.taken-{os.getpid()}"
            try:
                os.rename(self.path, taken)  # atomic: of two runs taking it over, one wins
                os.remove(taken)
            except FileNotFoundError:
                pass  # another run took it over first: try again
        raise RunLocked(f"could not take the run lock {self.path}: other runs keep taking it")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still this run's."""
        if self.holder is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        holder, self.holder = self.holder, None
        if holder.is_same(self._read()):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def _create(self, holder: LockHolder) -> bool:
        """Create the lock file with ``holder`` in it, complete or not at all; False if it exists."""
        temporary = self._write_temporary(holder)
        try:
            os.link(temporary, self.path)  # fails if the lock exists: never half-written, never replaced
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(temporary)

    def _write_temporary(self, holder: LockHolder) -> str:
        temporary = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "w") as handle:
            json.dump(asdict(holder), handle)
        return temporary

    def _read(self) -> Optional[LockHolder]:
        try:
            with open(self.path) as handle:
                return LockHolder(**json.load(handle))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return None  # damaged: treated as left by a dead run

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            holder = self.holder
            if holder is None:
                return
            current = self._read()
            if not holder.is_same(current):
                logger.warning("the run lock %s was taken over by another run (%s)", self.path, current and current.describe())
                return
            holder.heartbeat = time.time()
            try:
                os.replace(self._write_temporary(holder), self.path)
            except OSError as error:  # a full disk must not end the run
                logger.debug("could not refresh the run lock's heartbeat: %s", error)


class RunLocks:
    """The locks one run holds (its ``output_dir``'s, and its ``save_dir``'s when that lies elsewhere).

    Example:
        >>> import tempfile
        >>> locks = RunLocks([RunLock(tempfile.mkdtemp())])
        >>> locks.acquire()
        >>> locks.release()
    """

    def __init__(self, locks: Sequence[RunLock]) -> None:
        self.locks = list(locks)

    def acquire(self) -> None:
        """Take every lock, or none (those taken are given back when one is refused).

        Raises:
            RunLocked: a live run holds one of the directories.
        """
        taken: List[RunLock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in taken:
                lock.release()
            raise

    def release(self) -> None:
        """Give every lock back."""
        for lock in reversed(self.locks):
            lock.release()


def claim_run_lock(output_dir: str, backend: "TrainerBackend", also: Sequence[Tuple[str, str]] = ()) -> Optional[RunLocks]:
    """Rank zero takes ``output_dir``'s lock and those of the local directories in ``also``
    (``(directory, what)`` pairs, e.g. the checkpoints' ``save_dir``); every rank learns a
    refusal (call on every rank).

    Returns:
        the locks on rank zero (release them when training ends), None on the other ranks.

    Raises:
        RunLocked: on every rank, when a live run holds one of the directories.

    Example:
        locks = claim_run_lock(args.output_dir, trainer.backend, also=[(save_dir, "save_dir")])
    """
    locks, refusal = None, None
    if backend.is_main_process:
        locks = RunLocks([RunLock(output_dir), *(RunLock(directory, what=what) for directory, what in also)])
        try:
            locks.acquire()
        except RunLocked as error:
            refusal = str(error)
    refusal = backend.broadcast_object(refusal)  # a no-op on one rank
    if refusal is not None:
        raise RunLocked(refusal if backend.is_main_process else f"rank zero refused to start the run: {refusal}")
    return locks
