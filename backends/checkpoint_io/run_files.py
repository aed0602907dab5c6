"""The one door for a run's files: every byte of ``config.yaml``, ``run_id``, ``metrics.csv``,
checkpoints, their indexes and shards, ``state.pt``, safetensors and exports is read and written here.

Reads take **regular files only**: on a local disk the file is opened with ``O_NOFOLLOW`` (a
symlink in its place is refused, never followed out of the run) and ``O_NONBLOCK`` (a FIFO
cannot hang the run), then checked with ``fstat``: a device (``/dev/zero``), a FIFO or a
directory is refused before a byte is read, and so is a file larger than its kind's limit
(:class:`FileKind`). :func:`read_bytes` reads at most the limit plus one byte. On other
filesystems (fsspec URLs) the entry's type and size are checked before it is opened.

Writes go to a temporary name beside the target and are renamed into place with
``os.replace``: a symlink at the target is replaced, never written through, and a crash leaves
the old file or the new one, never half of one. Listings (:func:`list_entries`) leave symlinks out.

Every refusal is the kind's own error (``CorruptCheckpoint`` for checkpoint files, so the
previous checkpoint is used; :class:`UnsafeRunFile` otherwise), naming the file, what was found
and what is allowed. ``tests/test_architecture.py`` fails when code outside this module opens a
file or loads one (``open``, ``os.open``, ``torch.load``, ``fsspec.open``, ``fs.open``...).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "config.yaml")
    >>> write_bytes(path, b"trainer: {}\\n", CONFIG)
    >>> read_text(path, CONFIG)
    'trainer: {}\\n'
"""

import errno
import os
import pickle
import posixpath
import stat
import uuid
import zipfile
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, Type, Union, cast

import torch

from backends.checkpoint_io.base import CheckpointRefused, CorruptCheckpoint
from backends.checkpoint_io.local_files import LocalFiles, local_path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class UnsafeRunFile(ValueError):
    """A run file that is not a regular file of a sane size (a symlink, FIFO, device, directory,
    or larger than its kind admits); the message names the file and what was found.

    Example:
        >>> raise UnsafeRunFile("config.yaml /run/config.yaml is a symbolic link, not a regular file")
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.run_files.UnsafeRunFile: config.yaml /run/config.yaml is a symbolic link, not a regular file
    """


@dataclass(frozen=True)
class FileKind:
    """One kind of run file: what messages call it, the most bytes it may hold, the error its refusal raises.

    Example:
        >>> FileKind("notes", 10).limit
        10
    """

    name: str
    limit: int
    error: Type[Exception] = UnsafeRunFile


CONFIG = FileKind("config.yaml", 64 * MiB)
RUN_ID = FileKind("run id record", 4 * KiB)
METRICS = FileKind("metrics.csv", 4 * GiB)
LOCK = FileKind("run lock", MiB)  # its reader reads a few KiB of it at most
PROBE = FileKind("shared-storage probe", 4 * KiB)
CHECKPOINT = FileKind("checkpoint", 1 << 50, CorruptCheckpoint)
STATE = FileKind("sharded checkpoint's state.pt", 1 << 40, CorruptCheckpoint)
DCP_INDEX = FileKind("sharded checkpoint index .metadata", GiB, CorruptCheckpoint)
DCP_SHARD = FileKind("sharded checkpoint shard", 1 << 50, CorruptCheckpoint)
SAFETENSORS = FileKind("safetensors file", 1 << 50, CorruptCheckpoint)
SAFETENSORS_INDEX = FileKind("safetensors index", 100 * MiB, CorruptCheckpoint)
PREDICTIONS = FileKind("prediction part", 1 << 40, CorruptCheckpoint)
KINDS: Tuple[FileKind, ...] = (
    CONFIG,
    RUN_ID,
    METRICS,
    LOCK,
    PROBE,
    CHECKPOINT,
    STATE,
    DCP_INDEX,
    DCP_SHARD,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    PREDICTIONS,
)
"""Every kind the door handles (the hostile-input test walks them all)."""

# Protocols whose uploads are atomic: the object appears only once its upload completes.
ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})
TEMPORARY_SUFFIX = ".tmp"

Filesystem = Any  # an fsspec AbstractFileSystem, or LocalFiles
Content = Union[bytes, Callable[[IO[bytes]], Any]]
"""Bytes, or a function that writes them to a binary handle."""


def filesystem(url: str) -> Tuple[Filesystem, str]:
    """The filesystem and the path inside it for a local path or fsspec URL (a plain local
    path is served without importing fsspec).

    Example:
        >>> filesystem("/tmp/run")[1]
        '/tmp/run'
    """
    path = local_path(str(url))
    if path is not None:
        return LocalFiles(), path
    import fsspec  # on first use

    return cast(Tuple[Filesystem, str], fsspec.core.url_to_fs(str(url)))


def named_by_user(url: str) -> str:
    """A path the user named (``--config``, ``load_filename``, ``checkpoint=``) with its links
    followed once, on purpose: the door refuses links it meets, never the ones a user chose.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> os.symlink(os.path.join(directory, "real.yaml"), os.path.join(directory, "link.yaml"))
        >>> named_by_user(os.path.join(directory, "link.yaml")) == os.path.realpath(os.path.join(directory, "real.yaml"))
        True
    """
    path = local_path(str(url))
    return str(url) if path is None else os.path.realpath(path)


def is_local(fs: Filesystem) -> bool:
    """Whether ``fs`` is the local disk (paths are plain absolute paths).

    Example:
        >>> is_local(LocalFiles())
        True
    """
    if isinstance(fs, LocalFiles):
        return True
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _found(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(kind: FileKind, path: str, what: str) -> Exception:
    return kind.error(f"{kind.name} {path} {what}; only a regular file of at most {kind.limit} bytes is read")


def _not_regular(kind: FileKind, path: str, mode: int) -> Exception:
    return _refuse(kind, path, f"is {_found(mode)}, not a regular file")


def _open_local(path: str, kind: FileKind) -> Tuple[int, int]:
    """A descriptor of the regular file at ``path`` (never through a link) and its size."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _not_regular(kind, path, stat.S_IFLNK) from None
        raise
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise _not_regular(kind, path, status.st_mode)
        if status.st_size > kind.limit:
            raise _refuse(kind, path, f"is {status.st_size} bytes")
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, status.st_size


def _check_remote(fs: Filesystem, path: str, kind: FileKind) -> int:
    info = fs.info(path)
    if info.get("islink"):
        raise _not_regular(kind, fs.unstrip_protocol(path), stat.S_IFLNK)
    if info.get("type") != "file":
        raise _refuse(kind, fs.unstrip_protocol(path), f"is a {info.get('type')}, not a file")
    size = int(info.get("size") or 0)
    if size > kind.limit:
        raise _refuse(kind, fs.unstrip_protocol(path), f"is {size} bytes")
    return size


def open_file(fs: Filesystem, path: str, kind: FileKind, cache_remote: bool = False) -> IO[bytes]:
    """A binary read handle on the regular file ``path`` of ``fs`` (see the module docstring).

    Args:
        fs, path: the filesystem and the path inside it (:func:`filesystem`).
        kind: what the file is (its limit and its error).
        cache_remote: on other filesystems than the local disk, fetch the whole file once.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        kind.error: it is a link, FIFO, device, directory, or larger than ``kind.limit``.
    """
    if is_local(fs):
        descriptor, _ = _open_local(path, kind)
        return os.fdopen(descriptor, "rb")
    _check_remote(fs, path, kind)
    if cache_remote:
        try:
            return cast(IO[bytes], fs.open(path, "rb", cache_type="all"))
        except TypeError:  # a filesystem whose open() takes no cache options
            pass
    return cast(IO[bytes], fs.open(path, "rb"))


def file_size(fs: Filesystem, path: str, kind: FileKind) -> int:
    """The size of the regular file ``path`` (refused like :func:`open_file`).

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "run_id")
        >>> write_bytes(path, b"ab", RUN_ID)
        >>> file_size(LocalFiles(), path, RUN_ID)
        2
    """
    if is_local(fs):
        descriptor, size = _open_local(path, kind)
        os.close(descriptor)
        return size
    return _check_remote(fs, path, kind)


def read_bytes(fs_or_url: Union[Filesystem, str], path_or_kind: Any, kind: Optional[FileKind] = None) -> bytes:
    """The bytes of a regular file, at most ``kind.limit`` of them: ``read_bytes(url, kind)`` or
    ``read_bytes(fs, path, kind)``.

    Example:
        >>> import tempfile
        >>> link = os.path.join(tempfile.mkdtemp(), "run_id")
        >>> os.symlink("/dev/zero", link)
        >>> read_bytes(link, RUN_ID)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.run_files.UnsafeRunFile: run id record ... is a symbolic link, not a regular file; ...
    """
    fs, path, kind = _arguments(fs_or_url, path_or_kind, kind)
    blocks, total = [], 0
    with open_file(fs, path, kind) as handle:
        while total <= kind.limit:  # never more than limit + 1 bytes, however large the file grew since it was checked
            block = handle.read(min(1 << 24, kind.limit + 1 - total))
            if not block:
                break
            blocks.append(block)
            total += len(block)
    if total > kind.limit:  # grew since it was checked, or a filesystem that misreports sizes
        raise _refuse(kind, display(fs, path), f"holds more than {kind.limit} bytes")
    return b"".join(blocks)


def read_text(fs_or_url: Union[Filesystem, str], path_or_kind: Any, kind: Optional[FileKind] = None) -> str:
    """:func:`read_bytes` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_bytes(fs_or_url, path_or_kind, kind).decode("utf-8", errors="replace")


def load_torch(fs: Filesystem, path: str, kind: FileKind, weights_only: bool = True) -> Any:
    """``torch.load`` of the regular file ``path`` onto the CPU, after checking that it is one
    complete ``torch.save`` archive whose records match their CRCs.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CorruptCheckpoint: a link, FIFO, device or directory in its place; truncated or damaged.
        CheckpointRefused: ``weights_only`` loading refuses it (pickled objects, blocked modules),
            or bytes precede its archive (a pickle/zip polyglot).
    """
    name = display(fs, path)
    with open_file(fs, path, kind, cache_remote=True) as handle:
        handle.seek(0, os.SEEK_END)
        _check_archive(handle, handle.tell(), name)
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
        except (RuntimeError, EOFError, RecursionError, MemoryError) as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise CorruptCheckpoint(f"{type(error).__name__}: {first_line}") from error


def load_torch_mapped(fs: Filesystem, path: str, kind: FileKind) -> Any:
    """``torch.load(weights_only=True)`` of the regular file ``path`` with its tensors memory-mapped
    where the disk is local (only the pickle is read: for a record such as the run id), and no CRC
    check; any failure is the caller's to judge (what it needs may be unreadable)."""
    if not is_local(fs):
        with open_file(fs, path, kind) as handle:
            return torch.load(handle, map_location="cpu", weights_only=True)
    descriptor, _ = _open_local(path, kind)
    try:
        by_descriptor = f"/proc/self/fd/{descriptor}"  # the very file checked, whatever replaces the name meanwhile
        if os.path.exists(by_descriptor):
            return torch.load(by_descriptor, map_location="cpu", weights_only=True, mmap=True)
        with os.fdopen(os.dup(descriptor), "rb") as handle:
            return torch.load(handle, map_location="cpu", weights_only=True)
    finally:
        os.close(descriptor)


def verify_archive(fs: Filesystem, path: str, kind: FileKind) -> None:
    """Check, without unpickling, what :func:`load_torch` checks before it loads."""
    with open_file(fs, path, kind, cache_remote=True) as handle:
        handle.seek(0, os.SEEK_END)
        _check_archive(handle, handle.tell(), display(fs, path))


def _check_archive(handle: IO[bytes], size: int, name: str) -> None:
    handle.seek(0)
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


def _refusal_detail(message: str) -> str:
    """The line of torch's weights_only message that says what was refused."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "WeightsUnpickler error" in line:
            return line
    informative = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return informative[0] if informative else ""


def _arguments(fs_or_url: Any, path_or_kind: Any, kind: Optional[FileKind]) -> Tuple[Filesystem, str, FileKind]:
    if kind is None:
        fs, path = filesystem(fs_or_url)
        return fs, path, path_or_kind
    return fs_or_url, path_or_kind, kind


def display(fs: Filesystem, path: str) -> str:
    """How a path is named in messages: the plain path on a local disk, else its URL."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


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


def list_entries(fs: Filesystem, directory: str, types: Tuple[str, ...] = ("file", "directory")) -> List[str]:
    """Paths of the entries of ``directory`` of the given types (empty when it does not exist);
    symbolic links are left out (a run never follows a link out of its directories)."""
    fs.invalidate_cache(directory)
    try:
        entries: List[Dict[str, Any]] = fs.ls(directory, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [str(entry["name"]).rstrip("/") for entry in entries if entry.get("type") in types and not entry.get("islink")]


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
