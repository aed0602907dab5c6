"""The one reader of a sharded checkpoint's DCP part: every byte checked before DCP acts on it.

Every load of a sharded checkpoint (resume, ``validate``/``test``/``predict`` from a checkpoint,
``load_weights``, export from a checkpoint; ``sp``, ``ddp``, ``fsdp`` and ``model-parallel``, one
rank or many) goes through :func:`validated_index` and then :func:`reader`:

1. ``.metadata`` is read once; its SHA-256 must be the one ``state.pt`` records;
2. it is unpickled by :class:`~backends.checkpoint_io.dcp_index.IndexUnpickler` (only DCP's index classes);
3. :func:`~backends.checkpoint_io.dcp_index.check_index` admits only tensor entries for the keys ``state.pt`` names
   as sharded tensors, plain file names inside the directory, offsets and lengths inside those files;
4. every file the index names must match the SHA-256 recorded for it at save time.

DCP then reads with :class:`TensorOnlyPlanner` through a reader that serves that checked index (never
the file again) and refuses any request that is not a tensor, so no ``torch.load(weights_only=False)``
of DCP's default planner can run, whatever the index says.
"""

import copy
import hashlib
import pickle
import posixpath
from typing import Any, Collection, Dict, Mapping

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan

from backends.checkpoint_io import run_files
from backends.checkpoint_io.base import CheckpointRefused, CorruptCheckpoint
from backends.checkpoint_io.dcp_index import UnsafeIndex, check_index, read_index, refuse_bytes_items

INDEX_FILE = ".metadata"
INDEX_LIMIT = run_files.DCP_INDEX.limit
"""The largest ``.metadata`` read (bytes): an index describes tensors, it does not hold them."""


class TensorOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing every entry that is not a tensor (DCP unpickles those).

    Example:
        >>> planner = TensorOnlyPlanner()
        >>> planner.load_bytes(None, None)
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CorruptCheckpoint: a checkpoint entry asked to be unpickled: refused
    """

    def create_local_plan(self) -> LoadPlan:
        return refuse_bytes_items(super().create_local_plan())

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CorruptCheckpoint("a checkpoint entry asked to be unpickled: refused")


class _ValidatedMixin:
    """Serves the index checked by :func:`validated_index` (never re-reads ``.metadata``) and reads tensors only."""

    load_id: str
    _checked: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = copy.copy(self._checked)
        metadata.storage_meta = copy.copy(metadata.storage_meta) if metadata.storage_meta is not None else StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        return super().read_data(refuse_bytes_items(plan), planner)  # type: ignore[misc]


class ValidatedFileSystemReader(_ValidatedMixin, FileSystemReader):
    """DCP's local reader over a checked index.

    Example:
        fs, directory = fsspec.core.url_to_fs("runs/x/checkpoints/checkpoint-000000008")
        checked = validated_index(fs, directory, marker_paths(state), state["sharded"])
        dcp.load(targets, storage_reader=ValidatedFileSystemReader(directory, checked), planner=TensorOnlyPlanner())
    """

    def __init__(self, path: str, checked: Any) -> None:
        super().__init__(path)
        self._checked = checked


def reader(fs: Any, directory: str, checked: Any) -> Any:
    """DCP's storage reader for the checkpoint ``directory`` on ``fs``, serving the index ``checked``
    (from :func:`validated_index`) and reading tensors only."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        return ValidatedFileSystemReader(directory, checked)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class ValidatedFsspecReader(_ValidatedMixin, FsspecReader):
        def __init__(self, path: str, checked: Any) -> None:
            super().__init__(path)
            self._checked = checked

    return ValidatedFsspecReader(fs.unstrip_protocol(directory), checked)


def validated_index(
    fs: Any, directory: str, tensor_keys: Collection[str], recorded: Mapping[str, Any], restricted: bool = True
) -> Any:
    """DCP's ``Metadata`` of the checkpoint ``directory``, after every check in this module's docstring.

    Args:
        fs, directory: where the checkpoint is (an fsspec filesystem and its path there).
        tensor_keys: the keys ``state.pt`` names as sharded tensors.
        recorded: ``state.pt``'s ``"sharded"`` record: ``metadata_sha256`` and ``files_sha256``
            (``{file name: SHA-256}``; checkpoints written before it existed carry none).
        restricted: unpickle with :class:`~backends.checkpoint_io.dcp_index.IndexUnpickler` (False: the user trusts it).

    Raises:
        CheckpointRefused: the index names a global outside DCP's index classes (code could run).
        CorruptCheckpoint: anything else wrong, naming the entry or the file.
    """
    where = fs.unstrip_protocol(directory)
    path = posixpath.join(directory, INDEX_FILE)
    try:
        data = run_files.read_bytes(fs, path, run_files.DCP_INDEX)  # a regular file of at most INDEX_LIMIT bytes
    except FileNotFoundError as error:
        raise CorruptCheckpoint(f"its index {INDEX_FILE} is missing") from error
    expected = recorded.get("metadata_sha256")
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CorruptCheckpoint(
            f"its index {INDEX_FILE} does not match the digest saved with the checkpoint (damaged or replaced); "
            "it was not unpickled"
        )
    metadata = _unpickle(data, where, restricted)
    sizes = _file_sizes(fs, directory)
    check_index(metadata, tensor_keys, sizes, budget=max(len(data), 1))
    digests = recorded.get("files_sha256")
    if digests is not None:
        if not isinstance(digests, dict):
            raise CorruptCheckpoint(f"state.pt's shard digests are a {type(digests).__name__}, not a dict")
        for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
            if name not in digests:
                raise CorruptCheckpoint(f"the index names {name!r}, for which state.pt records no digest")
            if _digest(fs, posixpath.join(directory, name)) != digests[name]:
                raise CorruptCheckpoint(f"its shard {name!r} does not match the SHA-256 saved with the checkpoint (damaged)")
    return metadata


def shard_digests(fs: Any, directory: str, metadata: Any) -> Dict[str, str]:
    """``{file name: SHA-256}`` of every file the index ``metadata`` names (recorded at save time)."""
    names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    return {name: _digest(fs, posixpath.join(directory, name)) for name in names}


def _unpickle(data: bytes, where: str, restricted: bool) -> Any:
    import io

    try:
        if restricted:
            return read_index(io.BytesIO(data))
        metadata = pickle.loads(data)  # the user trusts this checkpoint (weights_only=False)
    except UnsafeIndex as error:
        raise CheckpointRefused(
            f"{where}: its DCP index {INDEX_FILE} is not a plain DCP index: {error}; refusing "
            "to load it (nothing in it was called). If you wrote it and trust it, set checkpointer_args.weights_only=False"
        ) from error
    except Exception as error:  # truncated or garbled: damaged
        raise CorruptCheckpoint(f"its index {INDEX_FILE} is unreadable ({type(error).__name__}: {str(error)[:200]})") from error
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CorruptCheckpoint(f"its index {INDEX_FILE} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _file_sizes(fs: Any, directory: str) -> Dict[str, int]:
    """The regular files directly in ``directory`` and their sizes (what an index may name)."""
    sizes: Dict[str, int] = {}
    for entry in fs.ls(directory, detail=True):
        if entry.get("type") == "file" and not entry.get("islink"):
            sizes[posixpath.basename(str(entry["name"]).rstrip("/"))] = int(entry.get("size") or 0)
    return sizes


def _digest(fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    with run_files.open_file(fs, path, run_files.DCP_SHARD) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
