"""Reading run files: regular files only, never through a link, never blocking, bounded by kind."""

import errno
import os
import stat
from typing import IO, Any, Dict, List, Optional, Tuple, Union, cast

from backends.checkpoint_io.local_files import LocalFiles, local_path
from backends.checkpoint_io.run_files.kinds import FileKind

Filesystem = Any  # an fsspec AbstractFileSystem, or LocalFiles


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
        >>> from backends.checkpoint_io.run_files import RUN_ID, write_bytes
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
        >>> from backends.checkpoint_io.run_files import RUN_ID
        >>> link = os.path.join(tempfile.mkdtemp(), "run_id")
        >>> os.symlink("/dev/zero", link)
        >>> read_bytes(link, RUN_ID)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.run_files.kinds.UnsafeRunFile: run id record ... is a symbolic link, not a regular file; ...
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


def _arguments(fs_or_url: Any, path_or_kind: Any, kind: Optional[FileKind]) -> Tuple[Filesystem, str, FileKind]:
    if kind is None:
        fs, path = filesystem(fs_or_url)
        return fs, path, path_or_kind
    return fs_or_url, path_or_kind, kind


def display(fs: Filesystem, path: str) -> str:
    """How a path is named in messages: the plain path on a local disk, else its URL."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def list_entries(fs: Filesystem, directory: str, types: Tuple[str, ...] = ("file", "directory")) -> List[str]:
    """Paths of the entries of ``directory`` of the given types (empty when it does not exist);
    symbolic links are left out (a run never follows a link out of its directories)."""
    fs.invalidate_cache(directory)
    try:
        entries: List[Dict[str, Any]] = fs.ls(directory, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [str(entry["name"]).rstrip("/") for entry in entries if entry.get("type") in types and not entry.get("islink")]
