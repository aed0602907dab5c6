"""Taking over a gone run's lock so that of any number of takers exactly one wins, and finding a
live run's lock around a directory.

A taker that judged the lock file gone hard-links it to a claim name made from that file's
content digest and inode: only one taker gets the name (``link`` never replaces). The winner
checks that the claim and the lock path are still the file it judged, renames its own complete
lock file over the lock path and removes the claim; a taker whose link finds the claim waits for
the winner and judges again (the winner's lock lives). A claim left by a taker that died in
those microseconds is removed once older than the stale window.
"""

import contextlib
import json
import logging
import os
import re
import socket
import time
import uuid
from typing import FrozenSet, Optional, Tuple

from backends.checkpoint_io import run_files
from framework.run.lock_file import (
    LOCK_NAME,
    LockFile,
    LockHolder,
    OddLockFile,
    process_start_time,
    read_lock_file,
    stale_reason,
)

logger = logging.getLogger("framework")

VERSION_DIR = re.compile(r"^version_\d+$")
"""A rerun's folder inside another run's ``output_dir`` (see :mod:`framework.run.run_directory`)."""
WAIT_FOR_TAKER_SECONDS = 2.0


def write_candidate(path: str) -> Tuple[LockHolder, str, float]:
    """This process's complete lock file for ``path`` under a unique name beside it, and the
    filesystem's time now (that file's mtime).

    Example:
        >>> import tempfile
        >>> holder, candidate, now = write_candidate(os.path.join(tempfile.mkdtemp(), LOCK_NAME))
        >>> holder.pid == os.getpid() and candidate.endswith(holder.token + ".new")
        True
    """
    now = time.time()
    started = process_start_time(os.getpid())
    mine = LockHolder(os.getpid(), socket.gethostname(), now, now, started if isinstance(started, float) else None)
    mine.token = uuid.uuid4().hex
    candidate = f"{path}.{mine.token}.new"
    filesystem_now = run_files.create_new(candidate, json.dumps(mine.__dict__).encode(), run_files.LOCK).st_mtime
    return mine, candidate, filesystem_now


def replace_gone_lock(
    path: str, current: LockFile, candidate: str, filesystem_now: float, stale_after: float, reason: str
) -> bool:
    """Replace the lock file ``current`` (judged gone for ``reason``) at ``path`` by ``candidate``.

    Returns:
        True when this process replaced it; False when the lock changed meanwhile (judge again).

    Raises:
        FileExistsError: another process is taking over the same lock right now (the message names its claim).
    """
    claim = f"{path}.gone-{current.digest[:16]}-{current.inode[1]}"
    try:
        os.link(path, claim)  # one name per judged lock: of all takers, one gets it
    except FileNotFoundError:
        return False
    except FileExistsError:
        _wait_for_other_taker(claim, filesystem_now, stale_after)
        return False
    try:
        linked, present = os.lstat(claim), os.lstat(path)
        if {(linked.st_dev, linked.st_ino), (present.st_dev, present.st_ino)} != {current.inode}:
            return False  # the lock changed since it was judged
        if current.holder is None:
            logger.warning("taking over the run lock %s: %s", path, reason)
        else:
            logger.warning(
                "taking over the run lock %s left by a run that is gone (%s): %s", path, current.describe(filesystem_now), reason
            )
        os.rename(candidate, path)
        return True
    except FileNotFoundError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(claim)


def _wait_for_other_taker(claim: str, filesystem_now: float, stale_after: float) -> None:
    """Another process claimed the same gone lock: give it a moment (it needs milliseconds)."""
    deadline = time.monotonic() + WAIT_FOR_TAKER_SECONDS
    while time.monotonic() < deadline:
        try:
            claimed = os.lstat(claim)
        except FileNotFoundError:
            return
        time.sleep(0.01)
    if filesystem_now - claimed.st_ctime > stale_after:  # its taker died while taking over
        with contextlib.suppress(FileNotFoundError):
            os.remove(claim)
        return
    raise FileExistsError(f"another run is taking over the run lock right now ({claim} exists): it will hold it")


def live_lock_around(
    directory: str, own_tokens: FrozenSet[str], filesystem_now: float, stale_after: float
) -> Optional[Tuple[str, LockFile]]:
    """``(enclosing directory, its lock)`` when a live run not holding one of ``own_tokens`` locks a
    directory around ``directory`` (that run's ``version_<N>`` folders aside), else None.

    Example:
        >>> import tempfile
        >>> live_lock_around(tempfile.mkdtemp(), frozenset(), time.time(), 120.0) is None
        True
    """
    here = os.path.realpath(directory)
    parent = os.path.dirname(here)
    while parent != here:
        inside = os.path.basename(here)  # the folder of ``parent`` that holds ``directory``
        try:
            found = read_lock_file(os.path.join(parent, LOCK_NAME))
        except (OddLockFile, OSError):
            found = None  # not a lock this run can judge: not a live run's
        holder = None if found is None else found.holder
        foreign = holder is not None and holder.token not in own_tokens and not VERSION_DIR.match(inside)
        if found is not None and foreign and stale_reason(found, filesystem_now, stale_after) is None:
            return parent, found
        here, parent = parent, os.path.dirname(parent)
    return None
