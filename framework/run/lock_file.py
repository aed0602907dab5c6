"""What a run lock file says, read without trusting it, and whether its holder still lives.

``run.lock`` is JSON written once by the run that takes the lock (its pid, host, the time it
took the lock, its process's start time and a random token) and never rewritten: its holder
proves it lives by touching the file, so the heartbeat is the file's modification time,
stamped by the filesystem's clock and compared with the same clock (the modification time
of a file this run has just written beside it). A lock of another host whose clock runs an
hour ahead therefore ages like any other. A modification time up to :data:`CLOCK_SKEW_SECONDS`
in the future counts as now; further ahead, no live holder's touch stamped it (a touch stamps
the filesystem's now), so the lock is stale, with the real difference in its message.

Reading never hangs and never crashes: the path is checked with ``lstat`` and opened with
``O_NONBLOCK | O_NOFOLLOW`` (a FIFO, a directory, a symlink or a device is
:class:`OddLockFile`, refused by the lock with a message naming it); at most
:data:`MAX_LOCK_BYTES` are read; a regular file whose fields do not parse is reported with
what is wrong and taken over.
"""

import hashlib
import json
import math
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

from backends.checkpoint_io import run_files
from backends.checkpoint_io.local_files import LocalFiles

LOCK_NAME = "run.lock"
MAX_LOCK_BYTES = 4096
"""A lock file is a few hundred bytes; a larger one is damaged (read no further)."""
LOCK_KIND = run_files.LOCK
CLOCK_SKEW_SECONDS = 60.0
"""How far in the future a heartbeat may lie and still count as now (clock steps, coarse timestamps)."""
SAME_START_SECONDS = 1.0
"""On one host, a live pid whose process started within this of the lock's recorded start is the holder."""
START_TOLERANCE_SECONDS = 2.0
"""Locks written before the process start was recorded: a process that started this much later than
the lock was taken cannot have taken it (pid reuse)."""


class OddLockFile(ValueError):
    """The lock path holds something that is not a regular file (a FIFO, a directory, a symlink...).

    Example:
        >>> raise OddLockFile("runs/a/run.lock is a FIFO, not a regular file")
        Traceback (most recent call last):
        ...
        framework.run.lock_file.OddLockFile: runs/a/run.lock is a FIFO, not a regular file
    """


@dataclass
class LockHolder:
    """Who holds a run lock: what ``run.lock`` holds (JSON).

    Attributes:
        pid, host: the holder's process and host name.
        started: when it took the lock (its clock).
        heartbeat: when it took the lock (its clock); the live heartbeat is the file's mtime.
        process_started: the start time of process ``pid`` (``/proc/<pid>/stat`` field 22), None on
            locks written before it was recorded or where ``/proc`` cannot tell.
        token: random, unique to this taking of the lock.

    Example:
        >>> LockHolder(4242, "node1", 0.0, 0.0, token="ab").describe(heartbeat_age=3.0).endswith("heartbeat 3 s ago")
        True
    """

    pid: int
    host: str
    started: float
    heartbeat: float
    process_started: Optional[float] = None
    token: str = ""

    def describe(self, heartbeat_age: Optional[float] = None) -> str:
        """``pid 4242 on host node1, started ..., heartbeat 3 s ago`` (for messages)."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        age = "" if heartbeat_age is None else f", heartbeat {_age_text(heartbeat_age)}"
        return f"pid {self.pid} on host {self.host}, started {started}{age}"


@dataclass
class LockFile:
    """A regular lock file as found: its holder (None when its fields do not parse, see ``problem``),
    its identity on disk and its modification time (the heartbeat)."""

    holder: Optional[LockHolder]
    problem: Optional[str]
    inode: Tuple[int, int]
    mtime: float
    digest: str
    fields: Dict[str, Any] = field(default_factory=dict)

    def age(self, filesystem_now: float) -> float:
        """Seconds since the last heartbeat by the filesystem's clock; negative for one from the future."""
        return filesystem_now - self.mtime

    def describe(self, filesystem_now: float) -> str:
        if self.holder is None:
            return f"a lock file whose fields do not parse: {self.problem}"
        return self.holder.describe(self.age(filesystem_now))


def _age_text(age: float) -> str:
    """``3 s ago``, or ``3600 s in the future`` (by the filesystem's clock): what the heartbeat really says.

    Example:
        >>> _age_text(3.2), _age_text(-31536000.0)
        ('3 s ago', '31536000 s in the future')
    """
    return f"{age:.0f} s ago" if age > -0.5 else f"{-age:.0f} s in the future"


def bounded(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (lock files are read, never trusted)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_lock_file(path: str) -> Optional[LockFile]:
    """The lock file at ``path``, or None when there is none.

    Raises:
        OddLockFile: ``path`` is not a regular file (never opened, so a FIFO cannot hang the run).

    Example:
        >>> import tempfile
        >>> read_lock_file(os.path.join(tempfile.mkdtemp(), LOCK_NAME)) is None
        True
    """
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(found.st_mode):
        raise OddLockFile(f"the run lock {path} is {_kind(found.st_mode)}, not a regular file")
    try:
        with run_files.open_file(LocalFiles(), path, LOCK_KIND) as handle:  # never through a link, never blocking
            opened = os.fstat(handle.fileno())
            data = handle.read(MAX_LOCK_BYTES + 1)
    except FileNotFoundError:
        return None
    except (OSError, run_files.UnsafeRunFile) as error:  # replaced by a link, FIFO... since the lstat, or unreadable
        raise OddLockFile(f"the run lock {path} cannot be opened as a regular file: {error}") from error
    holder, problem, fields = parse_holder(data)
    return LockFile(
        holder=holder,
        problem=problem,
        inode=(opened.st_dev, opened.st_ino),
        mtime=opened.st_mtime,
        digest=hashlib.sha256(data).hexdigest(),
        fields=fields,
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_holder(data: bytes) -> Tuple[Optional[LockHolder], Optional[str], Dict[str, Any]]:
    """``(holder, None, fields)``, or ``(None, what is wrong, fields)`` for bytes that are not a lock.

    Example:
        >>> parse_holder(b'{"pid": "12", "host": "a", "started": 0, "heartbeat": 0}')[1]
        "pid is '12', not a positive integer"
    """
    if len(data) > MAX_LOCK_BYTES:
        return None, f"larger than {MAX_LOCK_BYTES} bytes", {}
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        return None, f"not JSON ({bounded(str(error))})", {}
    if not isinstance(fields, dict):
        return None, f"not a JSON object ({type(fields).__name__})", {}
    pid, host = fields.get("pid"), fields.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None, f"pid is {bounded(pid)}, not a positive integer", fields
    if not isinstance(host, str) or not host or len(host) > 255:
        return None, f"host is {bounded(host)}, not a host name", fields
    for name in ("started", "heartbeat"):
        if not _number(fields.get(name)):
            return None, f"{name} is {bounded(fields.get(name))}, not a time in seconds", fields
    process_started, token = fields.get("process_started"), fields.get("token", "")
    if process_started is not None and not _number(process_started):
        return None, f"process_started is {bounded(process_started)}, not a time in seconds", fields
    if not isinstance(token, str) or len(token) > 64:
        return None, f"token is {bounded(token)}, not a short string", fields
    holder = LockHolder(pid, host, float(fields["started"]), float(fields["heartbeat"]), process_started, token)
    return holder, None, fields


def process_start_time(pid: int) -> Optional[Union[float, str]]:
    """When the process ``pid`` started (seconds since the epoch), ``"zombie"``, or None when
    ``/proc`` cannot tell (not Linux, or no such process).

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


def stale_reason(lock: LockFile, filesystem_now: float, stale_after: float) -> Optional[str]:
    """Why the holder of ``lock`` is gone (the lock may be taken over), or None while it may live.

    On this host a lock whose pid lives with the recorded process start time is alive whatever its
    heartbeat says (a paused run: SIGSTOP, a frozen cgroup, a suspended job); its pid gone, a zombie
    or started at another time (reused) is gone. Elsewhere, or where ``/proc`` cannot tell, a
    heartbeat older than ``stale_after`` seconds by the filesystem's clock is gone.
    """
    holder = lock.holder
    if holder is None:
        return f"its fields do not parse: {lock.problem}"
    age = lock.age(filesystem_now)
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return f"pid {holder.pid} is gone"
        except PermissionError:
            pass  # another user's live process
        started = process_start_time(holder.pid)
        if started == "zombie":
            return f"pid {holder.pid} is a zombie"
        if isinstance(started, float):
            if holder.process_started is not None:
                if abs(started - holder.process_started) <= SAME_START_SECONDS:
                    return None  # the holder itself, paused or not
                later = started - holder.process_started
                return f"pid {holder.pid} now belongs to another process (started {later:+.0f} s later)"
            if started > holder.started + START_TOLERANCE_SECONDS:
                return f"pid {holder.pid} now belongs to a process younger than the lock"
    if age < -CLOCK_SKEW_SECONDS:
        return (
            f"its heartbeat lies {-age:.0f} s in the future by the filesystem's clock (more than {CLOCK_SKEW_SECONDS:.0f} s "
            "ahead: a live holder's touch stamps the filesystem's now, so none has beaten since it was set)"
        )
    if age > stale_after:
        return f"its heartbeat is {age:.0f} s old (more than {stale_after:.0f} s)"
    return None
