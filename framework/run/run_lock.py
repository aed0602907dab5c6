"""One live run per directory: a lock file held by the running run's rank zero, and one writer only.

``<directory>/run.lock`` (:mod:`framework.run.lock_file`) names the holder: pid, host, process
start time and a random token. It is written once; the holder's daemon thread touches it every
:data:`HEARTBEAT_SECONDS` (nothing in the training loop), so its age is read on the filesystem's
clock. A second run on a directory whose holder lives (the same ``resume="auto"`` command
submitted twice) is refused before its first step, naming the holder. On the same host a holder
lives while its pid lives with the recorded start time, however old its heartbeat (a run paused
by SIGSTOP, a frozen cgroup or a suspended job is alive); a lock whose holder is gone (pid gone
or reused, or from another host a heartbeat older than :data:`STALE_AFTER_SECONDS`), or whose
fields do not parse, is taken over with a warning. A lock path that is not a regular file
(a FIFO, a directory) is refused with a message naming it, never opened.

Taking over is atomic (:mod:`framework.run.lock_takeover`): of any number of takers, one wins.

A run whose lock is taken over anyway (it was judged gone: stalled past the stale window as seen
from another host) finds out at its next heartbeat, before every checkpoint write, rename and
delete (:func:`check_lock_held`), and stops at its next step boundary with :class:`RunLockLost`,
writing nothing more. Every local directory a run writes is locked (its ``output_dir`` and its
``save_dir``, nested or not); a directory inside another live run's locked directory is refused,
except that run's ``version_<N>`` folders (where a rerun goes, see
:mod:`framework.run.run_directory`). A run removes its locks when training ends, by an error too;
a killed run leaves them, and the next run takes them over.
"""

import contextlib
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from framework.run.lock_file import (
    LOCK_NAME,
    START_TOLERANCE_SECONDS,
    LockFile,
    LockHolder,
    OddLockFile,
    process_start_time,
    read_lock_file,
    stale_reason,
)
from framework.run.lock_takeover import live_lock_around, replace_gone_lock, write_candidate

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend

logger = logging.getLogger("framework")

__all__ = [
    "HEARTBEAT_SECONDS",
    "LOCK_NAME",
    "STALE_AFTER_SECONDS",
    "START_TOLERANCE_SECONDS",
    "LockHolder",
    "RunLock",
    "RunLockLost",
    "RunLocked",
    "RunLocks",
    "check_lock_held",
    "claim_run_lock",
    "process_start_time",
    "reserve_directory",
]

HEARTBEAT_SECONDS = 10.0
"""How often the holder touches its lock (read when a :class:`RunLock` is made)."""
STALE_AFTER_SECONDS = 120.0
"""A lock of another host whose heartbeat is older than this is taken over (read when a :class:`RunLock` is made)."""
_ATTEMPTS = 20
_HELD: Dict[int, "RunLock"] = {}  # the locks this process holds, by id
_RESERVED: Dict[str, "RunLock"] = {}  # directories locked before their run claims them (version_N), by real path
_REGISTRY = threading.Lock()


class RunLocked(RuntimeError):
    """Another live run holds the directory; the message names its pid and host.

    Example:
        >>> raise RunLocked("output_dir 'runs/a' is in use by a live run (pid 4242 on host node1, ...)")
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLocked: output_dir 'runs/a' is in use by a live run (pid 4242 on host node1, ...)
    """


class RunLockLost(RunLocked):
    """This run's lock was taken over by another run: it stops and writes, renames and deletes nothing more.

    Example:
        >>> raise RunLockLost("the run lock runs/a/run.lock was taken over by another run (pid 4242 ...)")
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLockLost: the run lock runs/a/run.lock was taken over by another run (pid 4242 ...)
    """


class RunLock:
    """The lock on one directory, taken by :meth:`acquire`, checked by :meth:`check`, given back by :meth:`release`.

    Args:
        output_dir: the directory to lock (created when missing).
        heartbeat_seconds: how often the background thread touches the lock (default :data:`HEARTBEAT_SECONDS`).
        stale_after_seconds: age of another host's heartbeat after which its lock is taken over
            (default :data:`STALE_AFTER_SECONDS`).
        what: what the directory is, for messages (``"output_dir"`` or ``"save_dir"``).

    Example:
        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp())
        >>> lock.acquire()
        >>> RunLock(lock.output_dir).acquire()
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLocked: output_dir ... is in use by a live run (pid ...
        >>> lock.check()  # still this run's: no error
        >>> lock.release()
    """

    def __init__(
        self,
        output_dir: str,
        heartbeat_seconds: Optional[float] = None,
        stale_after_seconds: Optional[float] = None,
        what: str = "output_dir",
    ) -> None:
        self.output_dir = output_dir
        self.what = what
        self.option = "--checkpointer.save_dir" if what == "save_dir" else "--trainer.output_dir"
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.heartbeat_seconds = HEARTBEAT_SECONDS if heartbeat_seconds is None else heartbeat_seconds
        self.stale_after_seconds = STALE_AFTER_SECONDS if stale_after_seconds is None else stale_after_seconds
        self.holder: Optional[LockHolder] = None
        self.lost: Optional[str] = None
        """Why this run no longer holds the lock (it was taken over), or None."""
        self._on_lost: List[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._created = False

    # -- taking ---------------------------------------------------------------------------
    def acquire(self, own_tokens: FrozenSet[str] = frozenset()) -> None:
        """Take the lock, or take over a gone holder's, and start the heartbeat.

        Args:
            own_tokens: tokens of the other locks of the same run (an enclosing directory it holds).

        Raises:
            RunLocked: a live run holds it (named by pid and host), a live run holds a directory
                around it, or the lock path is not a regular file.
        """
        self._created = not os.path.isdir(self.output_dir)
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as error:  # nothing can be written there: the run's first write reports it
            logger.debug("not locking %s %s: %s", self.what, self.output_dir, error)
            return
        for _ in range(_ATTEMPTS):
            try:
                mine, candidate, filesystem_now = write_candidate(self.path)
            except OSError as error:
                raise OSError(
                    error.errno,
                    f"cannot write the run lock {self.path} in {self.what} {self.output_dir!r}: "
                    f"{error.strerror or error}. Make {self.what} writable (or free space there), or choose another "
                    f"{self.what} ({'--checkpointer.save_dir' if self.what == 'save_dir' else '--trainer.output_dir'})",
                ) from error
            try:
                taken = self._link(candidate) or self._take_over_if_gone(candidate, filesystem_now)
                if taken and self._won(mine):
                    break
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(candidate)
            time.sleep(random.uniform(0.001, 0.01))
        else:
            raise RunLocked(f"could not take the run lock {self.path}: other runs keep taking it")
        try:
            self._refuse_inside_a_live_run(own_tokens | {mine.token})
        except BaseException:
            self.release()
            raise

    def _link(self, candidate: str) -> bool:
        """Create the lock from ``candidate`` if there is none (atomic; never half-written)."""
        try:
            os.link(candidate, self.path)
            return True
        except FileExistsError:
            return False

    def _read(self) -> Optional[LockFile]:
        try:
            return read_lock_file(self.path)
        except OddLockFile as error:
            raise RunLocked(
                f"{error}: a lock file is a regular file written by the framework. Nothing was opened or changed; "
                f"remove {self.path} by hand if no run uses {self.what} {self.output_dir!r}, or choose another "
                f"{self.what} ({self.option})"
            ) from None

    def _take_over_if_gone(self, candidate: str, filesystem_now: float) -> bool:
        """Refuse when a live run holds the lock; take it over when its holder is gone (True when done)."""
        current = self._read()
        if current is None:
            return False  # released meanwhile: try again
        reason = stale_reason(current, filesystem_now, self.stale_after_seconds)
        if reason is None:
            raise RunLocked(
                f"{self.what} {self.output_dir!r} is in use by a live run ({current.describe(filesystem_now)}; lock file "
                f"{self.path}): two runs in one directory would overwrite each other's checkpoints. Wait for that "
                f"run to end or stop it; on its host a lock is taken over once its process is gone, from elsewhere once "
                f"its heartbeat is older than {self.stale_after_seconds:.0f} s. To start another run, choose another "
                f"{self.what} ({self.option})"
            )
        try:
            return replace_gone_lock(self.path, current, candidate, filesystem_now, self.stale_after_seconds, reason)
        except FileExistsError as error:
            raise RunLocked(f"{self.what} {self.output_dir!r}: {error}") from None

    def _won(self, mine: LockHolder) -> bool:
        """Read back what was won; start the heartbeat when it is this run's lock."""
        current = self._read()
        if current is None or current.holder is None or current.holder.token != mine.token:
            return False
        self.holder, self.lost = mine, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        with _REGISTRY:
            _HELD[id(self)] = self
        return True

    def _refuse_inside_a_live_run(self, own_tokens: FrozenSet[str]) -> None:
        """Refuse this directory when a live run (not this one) holds a directory around it, except that run's ``version_<N>``."""
        now = os.lstat(self.path).st_mtime
        found = live_lock_around(self.output_dir, own_tokens, now, self.stale_after_seconds)
        if found is not None:
            parent, lock = found
            raise RunLocked(
                f"{self.what} {self.output_dir!r} lies inside {parent!r}, which a live run holds ({lock.describe(now)}; "
                f"lock file {os.path.join(parent, LOCK_NAME)}): its retention and saves would touch this run's files. "
                f"Choose a {self.what} outside it ({self.option})"
            )

    # -- holding ----------------------------------------------------------------------------
    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the heartbeat thread) when the lock is found taken over."""
        self._on_lost.append(callback)

    def check(self) -> None:
        """Raise :class:`RunLockLost` when this run held the lock and another run has taken it (reads the file).

        Raises:
            RunLockLost: the lock is another run's now (or was removed, or replaced).
        """
        if self.holder is not None and self.lost is None:
            problem = self._not_mine()
            if problem is not None:
                self._lose(problem)
        if self.lost is not None:
            raise RunLockLost(self.lost)

    def _not_mine(self) -> Optional[str]:
        """How the lock file is no longer this run's, or None while it is."""
        holder = self.holder
        try:
            current = read_lock_file(self.path)
        except OddLockFile as error:
            return f"replaced: {error}"
        if current is None:
            return "removed by someone else"
        if holder is not None and current.holder is not None and current.holder.token == holder.token:
            return None
        now = time.time()
        return f"taken over by another run ({current.describe(now)})"

    def _lose(self, problem: str) -> None:
        self.lost = (
            f"the run lock {self.path} on {self.what} {self.output_dir!r} was {problem} while this run was stalled or "
            f"paused (seen from elsewhere, its heartbeat was older than {self.stale_after_seconds:.0f} s): this run "
            "stops at its next step boundary and writes, renames and deletes nothing more; the run that holds the "
            "lock now continues in the directory"
        )
        logger.error("%s", self.lost)
        for callback in self._on_lost:
            callback()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            if self.holder is None or self.lost is not None:
                return
            problem = self._not_mine()
            if problem is not None:
                self._lose(problem)
                return
            try:
                os.utime(self.path)  # the heartbeat: the file's mtime, by the filesystem's clock
            except OSError as error:  # a full disk must not end the run
                logger.debug("could not refresh the run lock's heartbeat: %s", error)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, if it is still this run's."""
        with _REGISTRY:
            _HELD.pop(id(self), None)
            for key, reserved in list(_RESERVED.items()):
                if reserved is self:
                    del _RESERVED[key]
        if self.holder is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        holder = self.holder
        lost, self.holder = self.lost is not None, None
        with contextlib.suppress(OSError, OddLockFile):
            present = read_lock_file(self.path)
            if not lost and present is not None and present.holder is not None and present.holder.token == holder.token:
                os.remove(self.path)
                if self._created:  # made only to hold the lock and left empty (no checkpoint was due): leave no trace
                    os.rmdir(self.output_dir)


def check_lock_held(path: str) -> None:
    """Raise :class:`RunLockLost` when a lock this process holds on ``path`` or a directory around
    it was taken over (call before writing, renaming or deleting in ``path``; reads the lock files).

    Example:
        >>> import tempfile
        >>> check_lock_held(tempfile.mkdtemp())  # no lock held there: nothing to check
    """
    target = os.path.realpath(path)
    with _REGISTRY:
        held = list(_HELD.values())
    for lock in held:
        directory = os.path.realpath(lock.output_dir)
        if target == directory or target.startswith(directory.rstrip(os.sep) + os.sep):
            lock.check()


def reserve_directory(directory: str) -> bool:
    """Lock ``directory`` now for the run this process is about to start there (a free ``version_<N>``):
    True when locked (or already reserved by this process: a start that failed before adopting it),
    False when a live run holds it. :func:`claim_run_lock` adopts the lock.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> reserve_directory(directory), reserve_directory(directory)
        (True, True)
        >>> RunLock(directory).acquire()  # another run
        Traceback (most recent call last):
        ...
        framework.run.run_lock.RunLocked: output_dir ... is in use by a live run (pid ...
        >>> claim_run_lock(directory, None).release()  # adopted, then given back
        >>> claim_run_lock(directory, None).release()  # adopted, then given back
    """
    key = os.path.realpath(directory)
    with _REGISTRY:
        if key in _RESERVED:
            return True
    lock = RunLock(directory)
    try:
        lock.acquire()
    except RunLocked:
        return False
    with _REGISTRY:
        _RESERVED[key] = lock
    return True


class RunLocks:
    """The locks one run holds (its ``output_dir``'s, and its ``save_dir``'s).

    Example:
        >>> import tempfile
        >>> locks = RunLocks([RunLock(tempfile.mkdtemp())])
        >>> locks.acquire()
        >>> locks.check()
        >>> locks.release()
    """

    def __init__(self, locks: Sequence[RunLock]) -> None:
        self.locks = list(locks)

    def acquire(self) -> None:
        """Take every lock (those already held, reserved, are kept), or none (given back when one is refused).

        Raises:
            RunLocked: a live run holds one of the directories or one around them.
        """
        try:
            for lock in self.locks:
                if lock.holder is None:
                    lock.acquire(frozenset(other.holder.token for other in self.locks if other.holder is not None))
        except BaseException:
            self.release()
            raise

    def check(self) -> None:
        """Raise :class:`RunLockLost` when another run has taken one of the locks."""
        for lock in self.locks:
            lock.check()

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a heartbeat thread) when one of the locks is found taken over."""
        for lock in self.locks:
            lock.on_lost(callback)

    def release(self) -> None:
        """Give every lock back."""
        for lock in reversed(self.locks):
            lock.release()


def claim_run_lock(
    output_dir: str, backend: Optional["TrainerBackend"], also: Sequence[Tuple[str, str]] = ()
) -> Optional[RunLocks]:
    """Rank zero takes ``output_dir``'s lock (or adopts the one :func:`reserve_directory` took) and those of
    the local directories in ``also`` (``(directory, what)`` pairs, e.g. the checkpoints' ``save_dir``);
    every rank learns a refusal (call on every rank; ``backend`` None: one process).

    Returns:
        the locks on rank zero (release them when training ends), None on the other ranks.

    Raises:
        RunLocked: on every rank, when a live run holds one of the directories.

    Example:
        locks = claim_run_lock(args.output_dir, trainer.backend, also=[(save_dir, "save_dir")])
    """
    locks, refusal = None, None
    if backend is None or backend.is_main_process:
        with _REGISTRY:
            reserved = _RESERVED.pop(os.path.realpath(output_dir), None)
        locks = RunLocks([reserved or RunLock(output_dir), *(RunLock(directory, what=what) for directory, what in also)])
        try:
            locks.acquire()
        except (RunLocked, OSError) as error:  # every rank learns it: none waits for a rank that stopped
            refusal = (isinstance(error, RunLocked), str(error), getattr(error, "errno", None))
    if backend is not None:
        refusal = backend.broadcast_object(refusal)  # a no-op on one rank
    if refusal is not None:
        locked, message, number = refusal
        if backend is not None and not backend.is_main_process:
            message = f"rank zero refused to start the run: {message}"
        raise RunLocked(message) if locked else OSError(number, message)
    return locks
