"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): the FSDP strategy's format.

Imported only when a sharded checkpoint is written or read (DCP is a heavy import).

A sharded checkpoint is a directory ``checkpoint-<step>/``:

- the module state and the optimizer states, written with DCP: each rank writes its own
  shards (``__<rank>_0.distcp``) and rank zero the index (``.metadata``), which records every
  tensor's global shape, so a later run on another number of ranks reads the slices it owns;
- ``state.pt``: everything else (counters, per-rank RNG states, schedulers, history...),
  written by rank zero through the checkpointer's :class:`~backends.checkpoint_io.base.CheckpointIO`
  and read with ``weights_only=True``; each sharded tensor appears there as a
  ``{"__sharded__": key}`` marker, and ``"sharded": {"metadata_sha256": ...}`` holds the
  digest of ``.metadata``;
- ``.complete``: written last.

Atomicity: every rank writes into ``.checkpoint-<step>.partial/``; once DCP has finished (its
last step gathers every rank's result), rank zero confirms that every shard file the index
names is there, as long as the index says, in its own view of the directory (where readers
look: a rank that wrote onto another node's own disk is caught here), then writes
``state.pt``, renames the directory into place and writes ``.complete``. A shard missing is
an error (:class:`ShardsMissing`): the checkpoint stays ``.partial``, never marked complete.

Safety: every read goes through :mod:`backends.checkpoint_io.dcp_reader`, the one reader: ``.metadata`` is
unpickled by :class:`~backends.checkpoint_io.dcp_index.IndexUnpickler` (only DCP's index classes: a hostile
index is :class:`~backends.checkpoint_io.base.CheckpointRefused` before anything in it is called),
then only tensor entries for the keys ``state.pt`` names, plain file names inside the directory
and offsets inside those files are admitted, and every file must match the SHA-256 recorded in
``state.pt`` (``"sharded": {"metadata_sha256", "files_sha256"}``); DCP reads with a planner that
refuses anything but tensors. Anything else is a damaged checkpoint
(:class:`~backends.checkpoint_io.base.CorruptCheckpoint`, naming the entry), skipped for an older one.
Every error DCP raises while reading (its ``CheckpointException`` is a ``BaseException``) is
reported as :class:`~backends.checkpoint_io.base.CorruptCheckpoint`.
"""

import contextlib
import logging
import posixpath
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from backends.checkpoint_io import dcp_reader, optimizer_names, run_files, stage_merge
from backends.checkpoint_io.base import CheckpointIO, CheckpointWriteError, CorruptCheckpoint, file_digest
from backends.checkpoint_io.sharded_state import (  # noqa: F401 - their public home was here
    MARKER_KEY,
    MAX_STATE_DEPTH,
    STATE_FILE,
    fill_sharded,
    marker_paths,
    split_sharded,
)

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
INDEX_FILE = ".metadata"
DIGEST_KEY = "sharded"


class ShardsMissing(OSError):
    """A sharded save finished on every rank, but rank zero does not find every shard in the
    checkpoint directory (the ranks wrote to different storage); the checkpoint is not marked complete.

    Example:
        >>> raise ShardsMissing("runs/x/.checkpoint-000000005.partial lacks __1_0.distcp ...")
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.sharded_checkpoint.ShardsMissing: runs/x/.checkpoint-000000005.partial lacks __1_0.distcp ...
    """


def initialize_optimizer_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Create the state of optimizers that have none yet (Adam's moments, momentum buffers), so a
    sharded checkpoint has tensors of the right sharding to load into.

    One step with zero gradients and a learning rate of 0 (the weights do not move); loading the
    checkpoint's optimizer state then replaces all of it, as in ``torch.distributed.checkpoint.state_dict``.
    """
    for optimizer in optimizers:
        if optimizer.state:
            continue
        learning_rates = [group["lr"] for group in optimizer.param_groups]
        given_grads = []
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            for parameter in group["params"]:
                if parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                    given_grads.append(parameter)
        optimizer.step()
        for group, learning_rate in zip(optimizer.param_groups, learning_rates):
            group["lr"] = learning_rate
        for parameter in given_grads:
            parameter.grad = None


def prepare_save(
    path: str,
    state: Dict[str, Any],
    io: CheckpointIO,
    *,
    is_main: bool,
    distributed: bool,
    on_rank_zero: Callable[[Callable[[], Any], str], Any],
    process_group: Any = None,
    copy: bool = False,
    stage_group: Any = None,
) -> Callable[[], None]:
    """Start a sharded save of ``state`` into the directory ``path`` (call on every rank); return
    the write, to run now or on a background thread (``copy``: tensors copied to CPU first, and
    DCP's collectives run over ``process_group``). ``stage_group``: a pipeline's group (its stages
    hold other tensors): rank zero's ``state.pt`` names every stage's (:mod:`~backends.checkpoint_io.stage_merge`)."""
    fs, final = fsspec.core.url_to_fs(path)
    final = final.rstrip("/")
    partial = posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.partial")
    tensors, rest = split_sharded(state)
    if stage_group is not None:
        stages: List[Any] = [None] * torch.distributed.get_world_size(stage_group)
        torch.distributed.all_gather_object(stages, rest, group=stage_group)
        rest = stage_merge.merged(stages)
    on_rank_zero(lambda: _fresh_directory(fs, partial), "prepare a sharded checkpoint directory")
    if copy:
        tensors = {key: _cpu_copy(tensor) for key, tensor in tensors.items()}
        rest = io.stage(rest)

    def write() -> None:
        try:
            with _single_process_quietly():
                metadata = dcp.save(
                    tensors, storage_writer=_writer(fs, partial), process_group=process_group, no_dist=not distributed
                )
        except CheckpointException as error:  # DCP's own: a BaseException holding each rank's
            raise _named_write_error(error, fs.unstrip_protocol(final)) from error
        if not is_main:
            return
        # Rank zero: DCP has gathered every rank's result; every shard must be where readers look.
        _confirm_shards(fs, partial, metadata)
        rest[DIGEST_KEY] = {
            "metadata_sha256": file_digest(fs.unstrip_protocol(posixpath.join(partial, INDEX_FILE))),
            "files_sha256": dcp_reader.shard_digests(fs, partial, metadata),
        }
        io.write(fs.unstrip_protocol(posixpath.join(partial, STATE_FILE)), rest)
        fs.invalidate_cache()  # the other ranks wrote their shards: no listing of before
        if fs.exists(final):  # the same step saved again (e.g. the final save after a step save)
            fs.rm(final, recursive=True)
        _move_directory(fs, partial, final)
        run_files.write_file(fs, posixpath.join(final, COMPLETE_MARKER), b"complete\n")

    return write


def load(
    path: str,
    io: CheckpointIO,
    target: Optional[Callable[[], Dict[str, Any]]] = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    distributed: bool = False,
    one_stage: bool = False,
    agree: Optional[Callable[[Optional[BaseException]], None]] = None,
) -> Dict[str, Any]:
    """Read the sharded checkpoint directory ``path``.

    ``one_stage``: this rank holds one stage of a pipeline: the checkpoint's other tensors are
    neither loaded nor returned (the state comes back with this stage's entries alone).

    With ``target`` (call on every rank): its tensors (this run's state, in its own sharding,
    whatever world size wrote the checkpoint) are loaded in place; ``optimizers`` without state
    get theirs created first, and optimizer tensors ``target()`` lacks are not restored.
    Without: full CPU tensors, in this process alone (no process group needed).

    ``agree`` (with ``target`` on several ranks): called on every rank with what this rank's
    local checks raised (None: nothing) once every check is done and before the collective read;
    it raises on every rank when any rank failed, so no rank enters DCP's collectives alone (one
    stage's optimizer state of another shape would otherwise leave its peer waiting there).

    Raises:
        FileNotFoundError: there is no directory at ``path``.
        CorruptCheckpoint: unfinished, damaged, or unreadable by DCP.
        CheckpointRefused: ``.metadata`` names globals a DCP index does not (code could run).
        ValueError: the checkpoint holds module tensors ``target()`` does not have.
    """
    fs, directory = fsspec.core.url_to_fs(path)
    directory = directory.rstrip("/")
    problem: Optional[BaseException] = None
    try:  # local checks only, up to the agreement: a collective here could meet another rank's raise
        verified = _just_verified.pop(path, None)  # verify() ran just before, on this rank: every file is hashed once
        rest, metadata = verified if verified is not None else _verified_state(fs, directory, path, io)
        paths = marker_paths(rest)
        if target is not None and optimizers and any(key.startswith("trainer/optimizers/") for key in paths):
            initialize_optimizer_state(optimizers)
        available = split_sharded(_in_layout_of(rest, target()))[0] if target is not None else {}
        missing = [key for key in paths if key.startswith("module/") and key not in available]
        if target is not None and missing and not one_stage:
            raise ValueError(
                f"the checkpoint holds tensors this run's module does not have: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; load it into the same model"
            )
        if target is not None:
            _check_shapes(metadata, {key: available[key] for key in paths if key in available}, fs.unstrip_protocol(directory))
    except Exception as error:
        problem = error
    if agree is not None and target is not None and distributed:
        agree(problem)
    if problem is not None:
        raise problem
    reader = dcp_reader.reader(fs, directory, metadata)  # serves the checked index, reads tensors only
    planner = dcp_reader.TensorOnlyPlanner
    try:
        with _single_process_quietly():
            if target is None:  # full tensors, sized from the DCP index
                targets = {}
                for key in paths:  # every one a tensor entry whose chunks lie in the files (checked)
                    entry = metadata.state_dict_metadata[key]
                    targets[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
                dcp.load(targets, storage_reader=reader, planner=planner(), no_dist=True)
            else:
                targets = {key: available[key] for key in paths if key in available}
                dcp.load(targets, storage_reader=reader, planner=planner(), no_dist=not distributed)
    except CorruptCheckpoint:
        raise
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise CorruptCheckpoint(
            f"torch.distributed.checkpoint could not read it: {type(error).__name__}: {first_line}"
        ) from error
    rest.pop(DIGEST_KEY, None)
    if one_stage:  # the other stages' tensors are theirs
        return fill_sharded(stage_merge.pruned(rest, set(targets)), targets)
    targets.update({key: torch.empty(0) for key in paths if key not in targets})  # not restored
    return fill_sharded(rest, targets)


def _in_layout_of(rest: Dict[str, Any], state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` (this run's) with its optimizer states numbered by position where the checkpoint's
    (``rest``) were written by position (before they were keyed by name), so its tensors load into them."""
    saved = rest.get("trainer", {}).get("optimizers", []) if isinstance(rest.get("trainer"), dict) else []
    trainer = state.get("trainer")
    if not isinstance(trainer, dict) or "optimizers" not in trainer:
        return state
    return {**state, "trainer": {**trainer, "optimizers": optimizer_names.aligned(saved, trainer["optimizers"])}}


def verify(path: str, io: CheckpointIO) -> None:
    """Raise what :func:`load` raises before it reads any tensor (no collective): the ranks of a
    collective read agree on this first, so none enters DCP's collectives alone.

    Raises:
        FileNotFoundError, CorruptCheckpoint, CheckpointRefused: as :func:`load`.
    """
    fs, directory = fsspec.core.url_to_fs(path)
    _just_verified.clear()
    _just_verified[path] = _verified_state(fs, directory.rstrip("/"), path, io)


_just_verified: Dict[str, Tuple[Dict[str, Any], Any]] = {}
"""What :func:`verify` found, for the :func:`load` of the same path that follows it (its shards are hashed once)."""


def _verified_state(fs: Any, directory: str, path: str, io: CheckpointIO) -> Tuple[Dict[str, Any], Any]:
    """``(state.pt, index)`` of a finished checkpoint whose index and shards passed :func:`dcp_reader.validated_index`."""
    fs.invalidate_cache()  # written by other processes: never a cached listing
    if not fs.isdir(directory):
        raise FileNotFoundError(f"sharded checkpoint directory {path!r} does not exist")
    if not fs.exists(posixpath.join(directory, COMPLETE_MARKER)):
        raise CorruptCheckpoint(f"no {COMPLETE_MARKER} marker: the save did not finish")
    try:
        rest = io.read(fs.unstrip_protocol(posixpath.join(directory, STATE_FILE)))
    except FileNotFoundError as error:
        raise CorruptCheckpoint(f"its {STATE_FILE} is missing") from error
    if not isinstance(rest, dict):
        raise CorruptCheckpoint(f"{STATE_FILE} is not a sharded checkpoint's state")
    recorded = rest.get(DIGEST_KEY, {})  # written before digests were recorded: checked without them
    if not isinstance(recorded, dict):
        raise CorruptCheckpoint(f"{STATE_FILE}'s {DIGEST_KEY!r} record is a {type(recorded).__name__}, not a dict")
    metadata = dcp_reader.validated_index(fs, directory, marker_paths(rest), recorded, restricted=io.weights_only)
    return rest, metadata


def _confirm_shards(fs: Any, directory: str, metadata: Any) -> None:
    """Raise :class:`ShardsMissing` unless every file the DCP index names is in ``directory``, as long as it says."""
    fs.invalidate_cache()  # the other ranks wrote their shards: no listing of before
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = []
    for name, size in sorted(needed.items()):
        path = posixpath.join(directory, name)
        found = fs.size(path) if fs.exists(path) else None
        if found is None or found < size:
            missing.append(f"{name} ({'absent' if found is None else f'{found} of {size} bytes'})")
    if missing:
        raise ShardsMissing(
            f"{fs.unstrip_protocol(directory)} lacks shards that other ranks wrote: {', '.join(missing)}; the checkpoint "
            "was not marked complete. The ranks wrote to different storage (each node its own disk?): save_dir must be "
            "a shared filesystem or an fsspec URL that every node reaches"
        )


def _check_shapes(metadata: Any, targets: Dict[str, torch.Tensor], where: str) -> None:
    """Refuse a checkpoint whose tensors have other (global) shapes than this run's: another model.

    Raises:
        ValueError: naming the first tensors whose shapes differ (never :class:`CorruptCheckpoint`:
            the checkpoint is intact, and an older one would not fit either).
    """
    entries = metadata.state_dict_metadata
    differing = [
        f"{key} {tuple(entries[key].size)} in the checkpoint, {tuple(tensor.shape)} in this run"
        for key, tensor in targets.items()
        if isinstance(entries.get(key), TensorStorageMetadata) and tuple(entries[key].size) != tuple(tensor.shape)
    ]
    if differing:
        raise ValueError(
            f"{where} was written by a model of another shape: {'; '.join(differing[:3])}"
            f"{f' (and {len(differing) - 3} more)' if len(differing) > 3 else ''}. Resume it with the model that wrote "
            "it, or start this model in a new output_dir (fine-tuning from a checkpoint needs the same shapes)"
        )


def _named_write_error(error: CheckpointException, where: str) -> BaseException:
    """A storage failure inside DCP's ``CheckpointException`` as :class:`CheckpointWriteError`
    naming the checkpoint, the rank and what to do; any other failure as DCP raised it."""
    for rank, (failure, _) in sorted(error.failures.items()):
        if isinstance(failure, OSError) and failure.errno is not None:
            return CheckpointWriteError(
                failure.errno,
                f"could not write sharded checkpoint {where} (rank {rank}): {failure.strerror or failure}. Free space "
                "there or make it writable, or choose another save_dir (--checkpointer.save_dir); the previous "
                "checkpoint is untouched",
            )
    return error


def _move_directory(fs: Any, source: str, target: str) -> None:
    """Rename ``source`` to ``target``; on an object store (no directories, no renames: s3, gcs)
    file by file (readers wait for ``.complete``, written after)."""
    if _is_local(fs):
        fs.mv(source, target, recursive=True)
        return
    for path in fs.find(source):
        fs.mv(path, posixpath.join(target, posixpath.relpath(path, source)))
    with contextlib.suppress(FileNotFoundError):
        fs.rm(source, recursive=True)


def _fresh_directory(fs: Any, path: str) -> None:
    if fs.exists(path):  # left by a run killed while saving this step
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's part that training may not change (a DTensor stays a DTensor)."""
    return tensor.detach().to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.detach().clone()


_is_local = run_files.is_local


def _writer(fs: Any, path: str) -> Any:
    if _is_local(fs):
        return dcp.FileSystemWriter(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not exported by the package in torch 2.13

    return FsspecWriter(fs.unstrip_protocol(path))
