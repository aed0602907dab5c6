"""Reading and writing checkpoint files through fsspec, atomically."""

import os
import pickle
import posixpath
import uuid
from typing import Any, List, Tuple

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem


class CheckpointRefused(ValueError):
    """A checkpoint holds pickled objects and ``weights_only`` loading is on."""


def resolve(url: str) -> Tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path inside it for a local path or fsspec URL."""
    return fsspec.core.url_to_fs(str(url))


def join(directory: str, name: str) -> str:
    """``directory/name`` in fsspec's '/'-separated form."""
    return posixpath.join(directory.rstrip("/"), name)


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    """``torch.save(obj)`` to a temporary name beside ``path``, then move it into place.

    A crash at any point leaves either the old file or the complete new one under ``path``,
    never a partial file. On local disks the data is fsynced before the rename.
    """
    directory, name = posixpath.split(path)
    fs.makedirs(directory, exist_ok=True)
    temporary = join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        if isinstance(fs, LocalFileSystem):
            with open(temporary, "wb") as handle:
                torch.save(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        else:
            with fs.open(temporary, "wb") as handle:
                torch.save(obj, handle)
            fs.mv(temporary, path)
    finally:
        if fs.exists(temporary):
            fs.rm(temporary)


def read(fs: fsspec.AbstractFileSystem, path: str, weights_only: bool) -> Any:
    """``torch.load`` a file written by :func:`write_atomically`, onto the CPU.

    Raises:
        CheckpointRefused: the file needs arbitrary unpickling and ``weights_only`` is on.
    """
    with fs.open(path, "rb") as handle:
        try:
            return torch.load(handle, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError as error:
            if not weights_only:
                raise
            raise CheckpointRefused(
                f"{path} holds pickled Python objects, which weights_only loading refuses because they can run "
                f"code. If you trust the file, set checkpointer_args.weights_only=False "
                f"(--checkpointer.weights_only false). Reason: {str(error).splitlines()[0]}"
            ) from error


def list_files(fs: fsspec.AbstractFileSystem, directory: str) -> List[str]:
    """Paths of the plain files in ``directory`` (empty when it does not exist)."""
    if not fs.exists(directory):
        return []
    return [entry["name"] for entry in fs.ls(directory, detail=True) if entry.get("type") == "file"]
