"""Reading and writing checkpoint files through fsspec, atomically.

Every write goes to a temporary name beside the target and is then moved into place, so
a reader (or a restarted run) sees either the old file or the complete new one under a
checkpoint name, never a partial one. On a local disk the data and the directory entry
are fsynced, so a completed save also survives a power loss. On object stores (``s3://``,
``gs://``, ``az://``...) an upload only becomes visible once it is complete, so the file
is written under its final name directly (a rename there would copy every byte again).

Reading checks the zip CRC of every record before unpickling, so a truncated file and a
file with flipped bytes are both reported as corrupt instead of loading garbage weights.
"""

import os
import pickle
import posixpath
import uuid
import zipfile
from typing import IO, Any, Callable, List, Tuple

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

TEMPORARY_SUFFIX = ".tmp"
"""Temporary files are named ``.<final name>.<random hex>.tmp``."""

# Protocols whose uploads are atomic: the object appears only once its upload completes.
_ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})

Serializer = Callable[[Any, IO[bytes]], None]


class CheckpointRefused(ValueError):
    """A checkpoint holds pickled objects and ``weights_only`` loading is on."""


class CorruptCheckpoint(ValueError):
    """A checkpoint file is truncated or damaged (the reason names what failed)."""


def resolve(url: str) -> Tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path inside it for a local path or fsspec URL."""
    return fsspec.core.url_to_fs(str(url))


def join(directory: str, name: str) -> str:
    """``directory/name`` in fsspec's '/'-separated form."""
    return posixpath.join(directory.rstrip("/"), name)


def same_location(first: str, second: str) -> bool:
    """True when two paths or URLs name the same directory (after resolving ``..``, ``~``, protocols)."""
    fs_a, path_a = resolve(first)
    fs_b, path_b = resolve(second)
    if isinstance(fs_a, LocalFileSystem) and isinstance(fs_b, LocalFileSystem):
        return os.path.realpath(path_a) == os.path.realpath(path_b)
    return fs_a.unstrip_protocol(path_a.rstrip("/")) == fs_b.unstrip_protocol(path_b.rstrip("/"))


def temporary_name(name: str) -> str:
    """A fresh temporary file name for a file that will be called ``name``."""
    return f".{name}.{uuid.uuid4().hex}{TEMPORARY_SUFFIX}"


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, obj: Any, serializer: Serializer = torch.save) -> None:
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
    directory, name = posixpath.split(path)
    fs.makedirs(directory, exist_ok=True)
    if fs.protocol and set(_as_tuple(fs.protocol)) & _ATOMIC_UPLOAD_PROTOCOLS:
        with fs.open(path, "wb") as handle:
            serializer(obj, handle)
        return
    temporary = join(directory, temporary_name(name))
    try:
        if isinstance(fs, LocalFileSystem):
            with open(temporary, "wb") as handle:
                serializer(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            _fsync_directory(directory)
        else:
            with fs.open(temporary, "wb") as handle:
                serializer(obj, handle)
            fs.mv(temporary, path)
    finally:
        if fs.exists(temporary):
            fs.rm(temporary)


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


def _open_for_reading(fs: fsspec.AbstractFileSystem, path: str) -> IO[bytes]:
    """A read handle; on remote filesystems the whole file is fetched once and kept in memory,
    so checking and loading it do not download it twice."""
    if isinstance(fs, LocalFileSystem):
        return fs.open(path, "rb")
    try:
        return fs.open(path, "rb", cache_type="all")
    except TypeError:  # a filesystem whose open() takes no cache options
        return fs.open(path, "rb")


def _check_archive(handle: IO[bytes], size: int) -> None:
    try:
        with zipfile.ZipFile(handle) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        raise CorruptCheckpoint(f"{size} bytes, not a complete checkpoint archive (truncated?): {error}") from error
    if damaged is not None:
        raise CorruptCheckpoint(f"record {damaged!r} does not match its CRC checksum (the file is damaged)")


def verify(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Check that ``path`` is a complete ``torch.save`` zip archive whose records match their CRCs.

    Raises:
        CorruptCheckpoint: the file is empty, truncated, not a zip archive, or a record's
            bytes do not match the checksum written with them.
    """
    with _open_for_reading(fs, path) as handle:
        _check_archive(handle, fs.size(path))


def read(fs: fsspec.AbstractFileSystem, path: str, weights_only: bool) -> Any:
    """``torch.load`` a file written by :func:`write_atomically`, onto the CPU, after checking it
    like :func:`verify`.

    Raises:
        CorruptCheckpoint: the file is truncated or damaged.
        CheckpointRefused: the file needs arbitrary unpickling and ``weights_only`` is on.
    """
    with _open_for_reading(fs, path) as handle:
        _check_archive(handle, fs.size(path))
        handle.seek(0)
        try:
            return torch.load(handle, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as error:
            message = str(error)
            if weights_only and "Unsupported global" in message:
                detail = next((line.strip() for line in message.splitlines() if "Unsupported global" in line), "")
                raise CheckpointRefused(
                    f"{fs.unstrip_protocol(path)} holds pickled Python objects, which weights_only loading refuses "
                    f"because unpickling them can run code. If you trust the file, set "
                    f"checkpointer_args.weights_only=False (--checkpointer.weights_only false). {detail}"
                ) from error
            detail = next((line.strip() for line in message.splitlines() if "WeightsUnpickler error" in line), "")
            raise CorruptCheckpoint(f"unpickling failed: {detail or (message.strip().splitlines() or [repr(error)])[0]}") from error
        except (RuntimeError, EOFError) as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise CorruptCheckpoint(f"{type(error).__name__}: {first_line}") from error


def list_files(fs: fsspec.AbstractFileSystem, directory: str) -> List[str]:
    """Paths of the plain files in ``directory`` (empty when it does not exist); never a cached listing."""
    fs.invalidate_cache(directory)
    if not fs.exists(directory):
        return []
    return [entry["name"] for entry in fs.ls(directory, detail=True) if entry.get("type") == "file"]
