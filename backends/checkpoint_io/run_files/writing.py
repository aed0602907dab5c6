"""Writing run files: a temporary beside the target, fsynced, then ``os.replace`` (a link is replaced, never written through)."""

import os
import posixpath
import stat
import uuid
from typing import IO, Any, Callable, Optional, Tuple, Union

from backends.checkpoint_io.run_files.kinds import FileKind
from backends.checkpoint_io.run_files.reading import Filesystem, _not_regular, filesystem, is_local

ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


TEMPORARY_SUFFIX = ".tmp"


Content = Union[bytes, Callable[[IO[bytes]], Any]]
"""Bytes, or a function that writes them to a binary handle."""


def temporary_name(name: str, tag: str = "") -> str:
    """A fresh temporary file name for a file that will be called ``name`` (``tag``: the writing run's id).

    Example:
        >>> temporary_name("config.yaml").startswith(".config.yaml.")
        True
    """
    return f".{name}.{tag}{uuid.uuid4().hex}{TEMPORARY_SUFFIX}"


def write_file(
    fs: Filesystem,
    path: str,
    content: Content,
    tag: str = "",
    before_replace: Optional[Callable[[str], None]] = None,
) -> None:
    """``content`` to a temporary file beside ``path``, then renamed into place.

    On a local disk the data is fsynced before the rename (``os.replace``: a symlink at ``path``
    is replaced, its target untouched) and the directory after it. On object stores whose uploads
    are atomic the file is written under its name directly. The temporary file never outlives a failure.

    Args:
        fs, path: where (:func:`filesystem`).
        content: the bytes, or a function that writes them to a binary handle.
        tag: put into the temporary file's name (the writing run's id).
        before_replace: called with the directory just before the rename (a last lock check).
    """
    serialize = content if callable(content) else lambda handle: handle.write(content)
    directory, name = posixpath.split(path)
    fs.makedirs(directory, exist_ok=True)
    if fs.protocol and set(_as_tuple(fs.protocol)) & ATOMIC_UPLOAD_PROTOCOLS:
        with fs.open(path, "wb") as handle:
            serialize(handle)
        return
    temporary = posixpath.join(directory, temporary_name(name, tag))
    try:
        if is_local(fs):
            with open(temporary, "xb") as handle:  # O_EXCL: a fresh file, never an existing one or a link
                serialize(handle)
                handle.flush()
                os.fsync(handle.fileno())
            if before_replace is not None:
                before_replace(directory)
            os.replace(temporary, path)
            _fsync_directory(directory)
        else:
            with fs.open(temporary, "wb") as handle:
                serialize(handle)
            if before_replace is not None:
                before_replace(directory)
            fs.mv(temporary, path)
    finally:
        _remove_quietly(fs, temporary)


def write_bytes(url: str, data: bytes, kind: FileKind) -> None:
    """Write ``data`` to ``url`` atomically (:func:`write_file`); refused when over ``kind.limit``.

    Example:
        >>> import tempfile
        >>> from backends.checkpoint_io.run_files import RUN_ID, read_bytes
        >>> path = os.path.join(tempfile.mkdtemp(), "run_id")
        >>> write_bytes(path, b"ab" * 16, RUN_ID); read_bytes(path, RUN_ID) == b"ab" * 16
        True
    """
    if len(data) > kind.limit:
        raise kind.error(f"{kind.name} {url} would be {len(data)} bytes, more than the {kind.limit} it may hold")
    fs, path = filesystem(url)
    write_file(fs, path, data)


def create_new(path: str, data: bytes, kind: FileKind) -> os.stat_result:
    """Create the local file ``path`` holding ``data``; it must not exist (not even as a link).

    Returns:
        The new file's status (its ``st_mtime`` is the filesystem's time now).

    Raises:
        FileExistsError: something is there already.
    """
    if len(data) > kind.limit:
        raise kind.error(f"{kind.name} {path} would be {len(data)} bytes, more than the {kind.limit} it may hold")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    descriptor = os.open(path, flags, 0o644)
    try:
        written = memoryview(data)
        while written:  # a short write (a full disk) is followed by one that says why
            written = written[os.write(descriptor, written) :]
        return os.fstat(descriptor)
    except BaseException:  # a full disk: no partial file is left behind
        os.remove(path)
        raise
    finally:
        os.close(descriptor)


def open_for_appending(path: str, kind: FileKind) -> IO[str]:
    """A text handle that appends to the regular local file ``path`` (written first by
    :func:`write_bytes`), never through a symlink put there since."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise _not_regular(kind, path, status.st_mode)
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "w", newline="", encoding="utf-8")


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


def _remove_quietly(fs: Filesystem, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    except OSError:  # the real error, if any, is the one being raised
        pass
