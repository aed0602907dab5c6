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
import errno
import logging
import os
import pickle
import posixpath
import re
import time
import uuid
import zipfile
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Tuple, TypeVar, cast

import torch

from backends.checkpoint_io import CheckpointRefused as CheckpointRefused  # defined beside the strategies' IO
from backends.checkpoint_io import CorruptCheckpoint as CorruptCheckpoint
from backends.checkpoint_io.local_files import LocalFiles, local_path
from framework.checkpoint import safe_types  # noqa: F401 - allows numpy and random values in user state
from framework.run.run_lock import check_lock_held

if TYPE_CHECKING:  # imported on first use: a run that never reaches a file does not pay for fsspec
    import fsspec

logger = logging.getLogger(__name__)


def _is_local(fs: "fsspec.AbstractFileSystem") -> bool:
    if isinstance(fs, LocalFiles):
        return True
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


TEMPORARY_SUFFIX = ".tmp"
"""Temporary files are named ``.<final name>.<random hex>.tmp``."""

# Protocols whose uploads are atomic: the object appears only once its upload completes.
_ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})

RETRY_DELAYS: Tuple[float, ...] = (0.05, 0.1, 0.2)
"""Seconds waited before each retry of a failed listing or read (so 1 + len(RETRY_DELAYS) attempts)."""

# OSErrors that describe the path, not a passing storage fault: never retried.
_NOT_TRANSIENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)

Serializer = Callable[[Any, IO[bytes]], None]
T = TypeVar("T")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed with an OS error (ENOSPC, EIO, ...); the message names the file.

    ``errno`` is the OS error's; the previous checkpoint is untouched.

    Example:
        >>> str(CheckpointWriteError(28, "could not write checkpoint runs/x/checkpoint-000000008.pt: No space left on device"))
        '[Errno 28] could not write checkpoint runs/x/checkpoint-000000008.pt: No space left on device'
    """


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
    path = local_path(str(url))
    if path is not None:
        return cast("fsspec.AbstractFileSystem", LocalFiles()), path
    import fsspec

    return fsspec.core.url_to_fs(str(url))


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
    return f".{name}.{_WRITING_RUN.get()}{uuid.uuid4().hex}{TEMPORARY_SUFFIX}"


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
    directory, name = posixpath.split(path)
    fs.makedirs(directory, exist_ok=True)
    if fs.protocol and set(_as_tuple(fs.protocol)) & _ATOMIC_UPLOAD_PROTOCOLS:
        with fs.open(path, "wb") as handle:
            serializer(obj, handle)
        return
    temporary = join(directory, temporary_name(name))
    try:
        if _is_local(fs):
            with open(temporary, "wb") as handle:
                serializer(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
            check_lock_held(directory)  # paused mid-save and taken over meanwhile: the new holder's files stay
            os.replace(temporary, path)
            _fsync_directory(directory)
        else:
            with fs.open(temporary, "wb") as handle:
                serializer(obj, handle)
            fs.mv(temporary, path)
    finally:
        _remove_quietly(fs, temporary)


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


def _remove_quietly(fs: "fsspec.AbstractFileSystem", path: str) -> None:
    """Remove a temporary file if it is there; a failure is logged, never raised over the real error."""
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove the temporary file %s: %s", display(fs, path), error)


def _as_tuple(protocol: Any) -> Tuple[str, ...]:
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _open_for_reading(fs: "fsspec.AbstractFileSystem", path: str) -> IO[bytes]:
    """A read handle; on remote filesystems the whole file is fetched once and kept in memory,
    so checking and loading it do not download it twice."""
    if _is_local(fs):
        return fs.open(path, "rb")
    try:
        return fs.open(path, "rb", cache_type="all")
    except TypeError:  # a filesystem whose open() takes no cache options
        return fs.open(path, "rb")


def _check_archive(handle: IO[bytes], size: int, name: str) -> None:
    try:
        with zipfile.ZipFile(handle) as archive:
            damaged = archive.testzip()
            first_record = min((info.header_offset for info in archive.infolist()), default=0)
    except OSError as error:
        if error.errno not in (None, errno.EINVAL):  # a storage fault (EIO, ...), not a damaged file
            raise
        raise CorruptCheckpoint(f"{size} bytes, not a complete checkpoint archive (truncated?): {error}") from error
    except (zipfile.BadZipFile, EOFError, ValueError) as error:
        raise CorruptCheckpoint(f"{size} bytes, not a complete checkpoint archive (truncated?): {error}") from error
    if damaged is not None:
        raise CorruptCheckpoint(f"record {damaged!r} does not match its CRC checksum (the file is damaged)")
    if first_record > 0:
        # torch.save starts the file with its archive. Bytes before it are a pickle/zip polyglot:
        # torch.load would unpickle those bytes instead of the archive that was checked.
        raise CheckpointRefused(
            f"{name} has {first_record} bytes before its zip archive, which torch.save never writes (a crafted "
            f"pickle/zip polyglot that torch.load would unpickle instead of the archive); refusing to load it"
        )


def verify(fs: "fsspec.AbstractFileSystem", path: str) -> None:
    """Check that ``path`` is a complete ``torch.save`` zip archive whose records match their CRCs.

    Raises:
        CorruptCheckpoint: the file is empty, truncated, not a zip archive, or a record's
            bytes do not match the checksum written with them.
        CheckpointRefused: bytes precede the archive (a polyglot file).
    """
    with _open_for_reading(fs, path) as handle:
        _check_archive(handle, fs.size(path), display(fs, path))


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
    with _open_for_reading(fs, path) as handle:
        _check_archive(handle, fs.size(path), name)
        handle.seek(0)
        try:
            return torch.load(handle, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as error:
            message = str(error)
            if weights_only:  # the archive is intact (CRCs match): this is what was written, not damage
                raise CheckpointRefused(
                    f"{name} holds pickled Python objects or code references, which weights_only loading refuses "
                    f"because unpickling them can run code. If you trust the file, set "
                    f"checkpointer_args.weights_only=False (--checkpointer.weights_only false). {_refusal_detail(message)}"
                ) from error
            raise CorruptCheckpoint(f"unpickling failed: {(message.strip().splitlines() or [repr(error)])[0]}") from error
        except (RuntimeError, EOFError) as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise CorruptCheckpoint(f"{type(error).__name__}: {first_line}") from error


def _refusal_detail(message: str) -> str:
    """The line of torch's weights_only message that says what was refused."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "WeightsUnpickler error" in line:
            return line
    informative = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return informative[0] if informative else ""


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
    def attempt() -> List[str]:
        fs.invalidate_cache(directory)
        try:
            entries = fs.ls(directory, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [entry["name"].rstrip("/") for entry in entries if entry.get("type") in types]

    return with_retries(attempt, f"listing checkpoints in {display(fs, directory)}")
