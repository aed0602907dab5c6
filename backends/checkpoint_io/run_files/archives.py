"""``torch.save`` archives read through the door: checked (CRCs, no bytes before the archive) before ``torch.load``."""

import errno
import os
import pickle
import zipfile
from typing import IO, Any

import torch

from backends.checkpoint_io.errors import CheckpointRefused, CorruptCheckpoint
from backends.checkpoint_io.run_files.kinds import FileKind
from backends.checkpoint_io.run_files.reading import Filesystem, _open_local, display, is_local, open_file


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
