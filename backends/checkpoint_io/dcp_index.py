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

An index made only of those classes can still mislead: an entry declared ``BytesStorageMetadata``
makes DCP's default planner ``torch.load(..., weights_only=False)`` its bytes, and a
``relative_path`` may name ``../another-checkpoint/...`` or an absolute path. :func:`check_index`
refuses every entry but a tensor the framework wrote, every file name but a plain one inside the
checkpoint directory, and every chunk, offset or length outside its tensor or its file.
"""

import io
import itertools
import pathlib
import pickle
import re
from typing import Any, BinaryIO, Callable, Collection, Dict, List, Mapping, Tuple

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from backends.checkpoint_io.base import CorruptCheckpoint

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
        >>> IndexUnpickler(io.BytesIO(pickle.dumps(print))).load()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.dcp_index.UnsafeIndex: the index names builtins.print, which is not part of a DCP index ...
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


def refuse_bytes_items(plan: Any) -> Any:
    """``plan`` (a DCP ``LoadPlan``), unless it asks for an entry as bytes (which DCP would unpickle).

    Raises:
        CorruptCheckpoint: naming the first entry a read would unpickle.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    for item in plan.items:
        if item.type != LoadItemType.TENSOR:
            raise CorruptCheckpoint(
                f"index entry {_short(item.dest_index.fqn)} would be read as pickled bytes (torch.load weights_only=False): "
                "refused"
            )
    return plan


class _SafeIndexMixin:
    """``read_metadata`` of DCP's ``FileSystemReader``, unpickling with :class:`IndexUnpickler`; ``read_data``
    refuses bytes entries. The framework's loads use :mod:`backends.checkpoint_io.dcp_reader`, which checks the whole index."""

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

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(refuse_bytes_items(plan), planner)  # type: ignore[misc]


class SafeFileSystemReader(_SafeIndexMixin, dcp_filesystem.FileSystemReader):
    """DCP's local ``FileSystemReader``, reading the index with :class:`IndexUnpickler`."""


def safe_fsspec_reader(url: str) -> Any:
    """DCP's ``FsspecReader`` for ``url``, reading the index with :class:`IndexUnpickler`."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(_SafeIndexMixin, FsspecReader):
        pass

    return SafeFsspecReader(url)


PLAIN_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
"""A file the index may name: a plain name inside the checkpoint directory (no separator, no ``..``, not hidden)."""


def check_index(metadata: Any, tensor_keys: Collection[str], file_sizes: Mapping[str, int], budget: int) -> None:
    """Refuse an index (read by :func:`read_index`) that asks for anything but the tensors the framework wrote.

    Args:
        metadata: DCP's ``Metadata``.
        tensor_keys: the keys written as tensors (the ``{"__sharded__": key}`` markers of ``state.pt``).
        file_sizes: the plain files in the checkpoint directory and their sizes in bytes.
        budget: how many chunks and entries may be visited (the index's size in bytes: shared references
            in a pickle cannot make the walk longer than the file).

    Raises:
        CorruptCheckpoint: naming the first entry that is not a tensor the framework wrote, a chunk outside
            its tensor, a storage entry naming a file that is not a plain name in the directory, or an
            offset or length outside that file (resuming skips such a checkpoint, as a damaged one).

    Example:
        >>> from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
        >>> check_index(Metadata({"module/w": BytesStorageMetadata()}), {"module/w"}, {}, 100)
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CorruptCheckpoint: index entry 'module/w' is a BytesStorageMetadata, not a tensor: \
refused (DCP would unpickle its bytes with weights_only=False)
    """
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or len(entries) > budget:
        raise CorruptCheckpoint(f"the index's entries are a {type(entries).__name__} of {_count(entries)}, not a dict of tensors")
    unknown = [key for key in entries if key not in tensor_keys]
    if unknown:
        raise CorruptCheckpoint(f"index entry {_short(unknown[0])} was not written as a tensor by the framework: refused")
    absent = [key for key in tensor_keys if key not in entries]
    if absent:
        raise CorruptCheckpoint(f"the index lacks the tensor {_short(absent[0])} that state.pt names")
    for key, entry in entries.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CorruptCheckpoint(
                f"index entry {_short(key)} is a {type(entry).__name__}, not a tensor: refused "
                "(DCP would unpickle its bytes with weights_only=False)"
            )
    _check_planner_data(metadata.planner_data, budget)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CorruptCheckpoint(f"the index's storage_data is a {type(storage).__name__}, not a dict")
    if len(storage) > budget:
        raise CorruptCheckpoint(f"the index's storage_data holds {len(storage)} entries, more than its {budget} bytes can")
    stored: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for index, info in storage.items():
        where = f"storage entry {_short(getattr(index, 'fqn', index))}"
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise CorruptCheckpoint(f"{where} is a {type(info).__name__}, not DCP's _StorageInfo")
        name = info.relative_path
        if not isinstance(name, str) or not PLAIN_FILE_NAME.match(name):
            raise CorruptCheckpoint(
                f"{where} names the file {_short(name)}: refused (only a plain file name inside the checkpoint directory)"
            )
        if name not in file_sizes:
            raise CorruptCheckpoint(f"{where} names {name!r}, which is not in the checkpoint directory")
        if info.transform_descriptors:
            transforms = _short(info.transform_descriptors)
            raise CorruptCheckpoint(f"{where} asks for transforms {transforms}, which the framework never writes")
        offset, length = info.offset, info.length
        if not (_natural(offset) and _natural(length) and offset + length <= file_sizes[name]):
            raise CorruptCheckpoint(
                f"{where}: bytes {_short(offset)}+{_short(length)} lie outside {name!r} ({file_sizes[name]} bytes)"
            )
        stored[(index.fqn, tuple(index.offset or ()))] = length
    if sum(len(getattr(entry, "chunks", ()) or ()) for entry in entries.values()) > len(stored):
        raise CorruptCheckpoint(
            f"the index describes more chunks than its {len(stored)} storage entries (a chunk referenced twice?): refused"
        )
    for key, entry in entries.items():
        shape, dtype = entry.size, getattr(entry.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not (isinstance(shape, tuple) and all(_natural(d) for d in shape)):
            raise CorruptCheckpoint(f"index entry {_short(key)} has no valid shape and dtype ({_short(shape)}, {_short(dtype)})")
        boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not (
                len(offsets) == len(sizes) == len(shape)
                and all(_natural(o) and _natural(s) and o + s <= d for o, s, d in zip(offsets, sizes, shape))
            ):
                raise CorruptCheckpoint(
                    f"index entry {_short(key)}: chunk at {_short(offsets)} of {_short(sizes)} lies outside {tuple(shape)}"
                )
            length = stored.pop((key, offsets), -1)
            if length < 0:
                twice = any(box[0] == offsets for box in boxes)
                raise CorruptCheckpoint(
                    f"index entry {_short(key)}: its chunk at {offsets} is "
                    + ("described twice (chunks may not overlap)" if twice else "stored nowhere")
                )
            needed = _numel(sizes) * dtype.itemsize
            if not needed <= length <= needed + CHUNK_OVERHEAD:
                raise CorruptCheckpoint(
                    f"index entry {_short(key)}: its chunk at {offsets} ({_numel(sizes)} {dtype} elements, {needed} bytes) "
                    f"is stored in {length} bytes"
                )
            boxes.append((offsets, sizes))
        _check_tiling(str(key), tuple(shape), boxes)
    if stored:
        (fqn, offsets), _ = next(iter(stored.items()))
        raise CorruptCheckpoint(f"storage entry {_short(fqn)} at {_short(offsets)} belongs to no chunk of the index: refused")


CHUNK_OVERHEAD = 1 << 20
"""How many bytes more than its elements a stored chunk may take (``torch.save``'s archive around them: ~1 KB)."""

GRID_CELLS_PER_CHUNK = 16
"""How many cells of the grid that chunk boundaries draw a tensor's chunks may make, per chunk, before the
check of their tiling walks them by a sweep instead (DCP's layouts make one cell per chunk)."""


def _check_tiling(key: str, shape: Tuple[int, ...], boxes: Any) -> None:
    """Refuse chunks (``(offsets, sizes)``, each inside ``shape``) that do not tile the tensor exactly: two that
    overlap, or elements no chunk holds. Every boundary a chunk draws cuts the tensor into a grid; each grid
    cell must be covered exactly once. Work: the number of cells (bounded), else a sweep along the first dimension."""
    total = _numel(shape)
    if sum(_numel(sizes) for _, sizes in boxes) != total:
        held = sum(_numel(sizes) for _, sizes in boxes)
        raise CorruptCheckpoint(
            f"index entry {_short(key)}: its chunks hold {held} elements, not the {total} of {shape}"
            + (" (chunks overlap)" if held > total else "")
        )
    if len(boxes) <= 1 or total == 0:
        return
    import bisect

    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + s[i] for o, s in boxes)}) for i, d in enumerate(shape)]
    cells = 1
    for dimension_cuts in cuts:
        cells *= max(len(dimension_cuts) - 1, 1)
    if cells <= GRID_CELLS_PER_CHUNK * len(boxes) + 64:
        covered: set = set()
        for offsets, sizes in boxes:
            ranges = [range(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s)) for c, o, s in zip(cuts, offsets, sizes)]
            for cell in itertools.product(*ranges):
                if cell in covered:
                    raise CorruptCheckpoint(f"index entry {_short(key)}: its chunk at {offsets} overlaps another chunk")
                covered.add(cell)
        return
    ordered = sorted(boxes)
    active: list = []
    for offsets, sizes in ordered:
        active = [(o, s) for o, s in active if o[0] + s[0] > offsets[0]]
        for other_offsets, other_sizes in active:
            if all(a < c + d and c < a + b for a, b, c, d in zip(offsets, sizes, other_offsets, other_sizes)):
                raise CorruptCheckpoint(f"index entry {_short(key)}: its chunk at {offsets} overlaps another chunk")
        active.append((offsets, sizes))


def _check_planner_data(planner_data: Any, budget: int) -> None:
    """DCP's default planner writes ``{key: (key, ...)}`` (flattened paths): flat, never nested deeper.
    Checked without recursion, so an index nested 100 000 levels deep is refused, not a ``RecursionError``."""
    if planner_data is None:
        return
    if not isinstance(planner_data, dict) or len(planner_data) > budget:
        raise CorruptCheckpoint(f"the index's planner_data is a {type(planner_data).__name__}, not a dict of key paths")
    for key, value in planner_data.items():
        if not (
            isinstance(key, str)
            and isinstance(value, (tuple, list))
            and len(value) <= budget
            and all(isinstance(part, (str, int)) for part in value)
        ):
            raise CorruptCheckpoint(
                f"the index's planner_data holds {type(value).__name__} under {type(key).__name__} "
                f"{key[:100]!r}, not a flat key path"
                if isinstance(key, str)
                else "a key that is not a string"
            )


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _numel(shape: Tuple[int, ...]) -> int:
    total = 1
    for dimension in shape:
        total *= dimension
    return total


def _count(value: Any) -> str:
    return f"{len(value)} items" if hasattr(value, "__len__") else "?"


def _short(value: Any) -> str:
    """``repr(value)``, at most 120 characters (an index may hold anything)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
