"""Reading DCP's pickled index (``.metadata``) with an unpickler that cannot run code.

``torch.distributed.checkpoint`` writes a sharded checkpoint's index with :mod:`pickle` and
reads it back with plain ``pickle.load``: a ``.metadata`` written by anyone who can write the
directory runs their code in every process that loads it. A digest stored beside it (in the
same directory) cannot protect against that: whoever rewrites one rewrites the other.

:class:`IndexUnpickler` admits only the classes DCP's own index is made of (read from
``torch/distributed/checkpoint/metadata.py`` and ``filesystem.py``): the metadata dataclasses,
``torch.Size``, dtypes, layouts and paths. Anything else (``os.system``, ``builtins.open``,
``builtins.eval``...) is refused before it is called, as ``torch.load(weights_only=True)``
refuses it for tensors. The readers :func:`safe_reader` returns read the index this way.
"""

import io
import pathlib
import pickle
from typing import Any, BinaryIO, Callable, Dict, Tuple

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

INDEX_CLASSES: Dict[Tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    **{
        ("torch.distributed.checkpoint.filesystem", name): getattr(dcp_filesystem, name)
        for name in ("_StorageInfo", "_StoragePrefix")
    },
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # read as a pure path: never touches the disk
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}
"""Every global DCP's index may name, and what it stands for: nothing that runs code."""


class UnsafeIndex(pickle.UnpicklingError):
    """The index names a global outside :data:`INDEX_CLASSES` (code would run): it was not loaded."""


class IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``; any other global raises :class:`UnsafeIndex` before it is called.

    Example:
        >>> import io, pickle
        >>> IndexUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load()
        torch.Size([2, 3])
        >>> IndexUnpickler(io.BytesIO(pickle.dumps(print))).load()
        Traceback (most recent call last):
        ...
        backends.dcp_index.UnsafeIndex: the index names builtins.print, which is not part of a DCP index (it could run code)
    """

    def find_class(self, module: str, name: str) -> Any:
        found = INDEX_CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeIndex(f"the index names {module}.{name}, which is not part of a DCP index (it could run code)")


def read_index(handle: BinaryIO) -> Any:
    """DCP's ``Metadata`` from the open ``.metadata`` file ``handle``, read by :class:`IndexUnpickler`.

    Raises:
        UnsafeIndex: it names a global that is not part of a DCP index.
        pickle.UnpicklingError / EOFError / ValueError: it is damaged.
    """
    metadata = IndexUnpickler(io.BytesIO(handle.read())).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f"the index holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _SafeIndexMixin:
    """``read_metadata`` of DCP's ``FileSystemReader``, unpickling with :class:`IndexUnpickler`."""

    fs: Any
    load_id: str
    _get_metadata_path: Callable[..., Any]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as handle:
            metadata = read_index(handle)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeIndexMixin, dcp_filesystem.FileSystemReader):
    """DCP's local ``FileSystemReader``, reading the index with :class:`IndexUnpickler`."""


def safe_fsspec_reader(url: str) -> Any:
    """DCP's ``FsspecReader`` for ``url``, reading the index with :class:`IndexUnpickler`."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(_SafeIndexMixin, FsspecReader):
        pass

    return SafeFsspecReader(url)
