"""Reading and writing checkpoint files through fsspec (plain local paths through ``os``), atomically.

Every write goes to a temporary name beside the target and is then moved into place, so
a reader (or a restarted run) sees either the old file or the complete new one under a
checkpoint name, never a partial one. On a local disk the data and the directory entry
are fsynced, so a completed save also survives a power loss. On object stores (``s3://``,
``gs://``, ``az://``...) an upload only becomes visible once it is complete, so the file
is written under its final name directly (a rename there would copy every byte again).

Reading checks the zip CRC of every record before unpickling, so a truncated file and a
file with flipped bytes are both reported as corrupt instead of loading garbage weights.
A file that is intact but that ``weights_only`` loading refuses (blocked globals, bytes
before the archive) is :class:`CheckpointRefused`: never "corrupt", never skipped.

Listing and reading retry an ``OSError`` (EIO, a permission glitch) a few times with a short
backoff, then raise it: a storage error never looks like "no checkpoint" or "damaged file".
A failed write raises :class:`CheckpointWriteError`, naming the file and the OS error.
"""

import contextlib
import contextvars
import logging
import os
import posixpath
import re
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Tuple, TypeVar

import torch

from backends.checkpoint_io import CheckpointRefused as CheckpointRefused  # defined beside the strategies' IO
from backends.checkpoint_io import CorruptCheckpoint as CorruptCheckpoint
from backends.checkpoint_io import run_files
from backends.checkpoint_io.base import CheckpointWriteError as CheckpointWriteError  # defined beside the strategies' IO
from framework.checkpoint import safe_types  # noqa: F401 - allows numpy and random values in user state
from framework.run.run_lock import check_lock_held

if TYPE_CHECKING:  # imported on first use: a run that never reaches a file does not pay for fsspec
    import fsspec

logger = logging.getLogger(__name__)


_is_local = run_files.is_local
TEMPORARY_SUFFIX = run_files.TEMPORARY_SUFFIX
"""Temporary files are named ``.<final name>.<random hex>.tmp``."""

RETRY_DELAYS: Tuple[float, ...] = (0.05, 0.1, 0.2)
"""Seconds waited before each retry of a failed listing or read (so 1 + len(RETRY_DELAYS) attempts)."""

# OSErrors that describe the path, not a passing storage fault: never retried.
_NOT_TRANSIENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)

Serializer = Callable[[Any, IO[bytes]], None]
T = TypeVar("T")


def display(fs: "fsspec.AbstractFileSystem", path: str) -> str:
    """How a path is named in messages: the plain path on a local disk, else its URL."""
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def with_retries(operation: Callable[[], T], description: str) -> T:
    """``operation()``, retried after ``RETRY_DELAYS`` when it raises an ``OSError`` (other than
    "no such file" and its kind); the last failure is raised, naming ``description``.

    Example:
        >>> with_retries(lambda: 42, "reading nothing")
        42
    """
    for delay in (*RETRY_DELAYS, None):
        try:
            return operation()
        except _NOT_TRANSIENT:
            raise
        except OSError as error:
            if delay is None:
                attempts = len(RETRY_DELAYS) + 1
                raise OSError(error.errno, f"{description} failed {attempts} times, last: {error.strerror or error}") from error
            logger.warning("%s failed (%s); retrying in %.2f s", description, error, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def resolve(url: str) -> Tuple["fsspec.AbstractFileSystem", str]:
    """The filesystem and path inside it for a local path or fsspec URL (a plain local path is
    served without importing fsspec: :mod:`backends.checkpoint_io.local_files`)."""
    return run_files.filesystem(url)


def join(directory: str, name: str) -> str:
    """``directory/name`` in fsspec's '/'-separated form."""
    return posixpath.join(directory.rstrip("/"), name)


def same_location(first: str, second: str) -> bool:
    """True when two paths or URLs name the same directory (after resolving ``..``, ``~``, protocols)."""
    fs_a, path_a = resolve(first)
    fs_b, path_b = resolve(second)
    if _is_local(fs_a) and _is_local(fs_b):
        return os.path.realpath(path_a) == os.path.realpath(path_b)
    return fs_a.unstrip_protocol(path_a.rstrip("/")) == fs_b.unstrip_protocol(path_b.rstrip("/"))


_WRITING_RUN: "contextvars.ContextVar[str]" = contextvars.ContextVar("writing_run", default="")


@contextlib.contextmanager
def temporaries_of(run_id: Optional[str]) -> Iterator[None]:
    """Temporary names made inside carry ``run_id`` (32 hex digits), so a cleanup knows whose they are
    (see :func:`temporary_run_id`); another value is left out."""
    token = _WRITING_RUN.set(run_id if isinstance(run_id, str) and re.fullmatch("[0-9a-f]{32}", run_id) else "")
    try:
        yield
    finally:
        _WRITING_RUN.reset(token)


def temporary_name(name: str) -> str:
    """A fresh temporary file name for a file that will be called ``name`` (with the writing run's id
    inside :func:`temporaries_of`).

    Example:
        >>> with temporaries_of("ab" * 16):
        ...     temporary_run_id(temporary_name("checkpoint-000000001.pt")) == "ab" * 16
        True
    """
    return run_files.temporary_name(name, _WRITING_RUN.get())


def temporary_run_id(name: str) -> Optional[str]:
    """The run id in a temporary file's name, or None when it carries none (written before it did)."""
    match = re.search(r"\.([0-9a-f]{64})" + re.escape(TEMPORARY_SUFFIX) + "$", name)
    return match.group(1)[:32] if match else None


def write_atomically(fs: "fsspec.AbstractFileSystem", path: str, obj: Any, serializer: Serializer = torch.save) -> None:
    """``serializer(obj, handle)`` to a temporary name beside ``path``, then move it into place.

    A crash at any point leaves either the old file or the complete new one under ``path``,
    never a partial file (at worst a leftover ``.<name>.<hex>.tmp``). On local disks the
    data is fsynced before the rename and the directory after it.

    Args:
        fs: the filesystem (from :func:`resolve`).
        path: the final path inside ``fs``.
        obj: what to write.
        serializer: writes ``obj`` to a binary handle (default ``torch.save``).

    Example:
        >>> fs, path = resolve("memory://doc-storage/state.pt")
        >>> write_atomically(fs, path, {"w": torch.zeros(2)})
        >>> read(fs, path, weights_only=True)["w"]
        tensor([0., 0.])
    """
    try:
        _write_atomically(fs, path, obj, serializer)
    except Exception as error:
        os_error = _os_error_in(error)
        if os_error is None:
            raise
        reason = os_error.strerror or str(os_error)
        raise CheckpointWriteError(os_error.errno, f"could not write checkpoint {display(fs, path)}: {reason}") from error


def _write_atomically(fs: "fsspec.AbstractFileSystem", path: str, obj: Any, serializer: Serializer) -> None:
    run_files.write_file(fs, path, lambda handle: serializer(obj, handle), tag=_WRITING_RUN.get(), before_replace=check_lock_held)


def _os_error_in(error: BaseException) -> Optional[OSError]:
    """The OS error behind ``error``: itself, or one it was raised from or while handling
    (``torch.save`` turns a failed write into ``RuntimeError: enforce fail at inline_container.cc``)."""
    seen = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def verify(fs: "fsspec.AbstractFileSystem", path: str) -> None:
    """Check that ``path`` is a complete ``torch.save`` zip archive whose records match their CRCs.

    Raises:
        CorruptCheckpoint: the file is empty, truncated, not a zip archive, not a regular file,
            or a record's bytes do not match the checksum written with them.
        CheckpointRefused: bytes precede the archive (a polyglot file).
    """
    run_files.verify_archive(fs, path, run_files.CHECKPOINT)


def read(fs: "fsspec.AbstractFileSystem", path: str, weights_only: bool) -> Any:
    """``torch.load`` a file written by :func:`write_atomically`, onto the CPU, after checking it
    like :func:`verify`.

    An ``OSError`` (EIO, permission) is retried (``RETRY_DELAYS``), then raised.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CorruptCheckpoint: the file is truncated or damaged.
        CheckpointRefused: ``weights_only`` loading refuses the file (pickled objects, blocked
            modules), or bytes precede its archive.
        OSError: the storage failed on every attempt.
    """
    name = display(fs, path)
    return with_retries(lambda: _read_once(fs, path, name, weights_only), f"reading checkpoint {name}")


def _read_once(fs: "fsspec.AbstractFileSystem", path: str, name: str, weights_only: bool) -> Any:
    return run_files.load_torch(fs, path, run_files.CHECKPOINT, weights_only=weights_only)


def list_entries(fs: "fsspec.AbstractFileSystem", directory: str) -> List[str]:
    """Paths of the files and directories in ``directory`` (empty when it does not exist), as
    :func:`list_files` (never cached, retried)."""
    return _list(fs, directory, ("file", "directory"))


def list_files(fs: "fsspec.AbstractFileSystem", directory: str) -> List[str]:
    """Paths of the plain files in ``directory`` (empty when it does not exist); never a cached listing.

    An ``OSError`` other than "does not exist" (EIO, permission) is retried, then raised: a
    directory that cannot be listed is never taken for an empty one.
    """

    return _list(fs, directory, ("file",))


def _list(fs: "fsspec.AbstractFileSystem", directory: str, types: Tuple[str, ...]) -> List[str]:
    return with_retries(lambda: run_files.list_entries(fs, directory, types), f"listing checkpoints in {display(fs, directory)}")
