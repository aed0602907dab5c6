"""ShardedCheckpointer: checkpoints that every rank writes in parallel and any world size resumes.

A sharded checkpoint is a directory ``checkpoint-<step>/``:

- the module state and the optimizer states, written with ``torch.distributed.checkpoint``
  (DCP): each rank writes its own shards (``__<rank>_0.distcp``) and rank zero the index
  (``.metadata``), which records every tensor's global shape, so a later run on another
  number of ranks reads exactly the slices it owns;
- ``state.pt``: everything else of the :class:`Checkpoint` (counters, position in the epoch,
  per-rank RNG states, schedulers, history, scaler...), written by rank zero with
  ``torch.save`` and read with ``weights_only=True``; each sharded tensor appears there as a
  ``{"__sharded__": key}`` marker;
- ``.complete``: written last.

Atomicity: every rank writes into ``.checkpoint-<step>.partial/``; once DCP has finished
(its last step gathers every rank's result), rank zero writes ``state.pt``, renames the
directory into place and writes ``.complete``. A crash at any point leaves no complete
``checkpoint-<step>`` directory, and a directory without ``.complete`` (or one that fails
to read) is skipped on resume with a warning, falling back to the previous one.
"""

import contextlib
import logging
import re
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from framework.checkpoint import storage
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.default import DefaultCheckpointer, copy_to_cpu, loaded_directory

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
COMPLETE_MARKER = ".complete"
MARKER_KEY = "__sharded__"
_DIRECTORY_NAME = re.compile(r"^checkpoint-(\d+)$")


def sharded_checkpoint_name(global_step: int) -> str:
    """Directory name of the sharded checkpoint taken after ``global_step`` optimizer steps."""
    return f"checkpoint-{global_step:09d}"


def split_sharded(data: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(tensors, rest)``: the tensors of the module state, the optimizer and the callback states, keyed by
    their path (``"module/model/head.weight"``, ``"trainer/optimizers/0/state/3/exp_avg"``), and
    ``data`` with each of them replaced by a ``{"__sharded__": path}`` marker.

    Example:
        >>> tensors, rest = split_sharded({"module": {"w": torch.ones(2)}, "trainer": {"optimizers": []}, "epoch": 1})
        >>> list(tensors), rest["module"]
        (['module/w'], {'w': {'__sharded__': 'module/w'}})
    """
    tensors: Dict[str, torch.Tensor] = {}

    def replace(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {MARKER_KEY: path}
        if isinstance(value, dict):
            return type(value)((key, replace(item, f"{path}/{key}")) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(replace(item, f"{path}/{index}") for index, item in enumerate(value))
        return value

    rest = dict(data)
    rest["module"] = replace(data["module"], "module")
    trainer = dict(data["trainer"])
    trainer["optimizers"] = replace(trainer.get("optimizers", []), "trainer/optimizers")
    trainer["callbacks"] = replace(trainer.get("callbacks", []), "trainer/callbacks")  # EMA's sharded average
    rest["trainer"] = trainer
    return tensors, rest


def fill_sharded(rest: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_sharded`: markers replaced by ``tensors[path]``."""
    if isinstance(rest, dict):
        if set(rest) == {MARKER_KEY}:
            return tensors[rest[MARKER_KEY]]
        return type(rest)((key, fill_sharded(value, tensors)) for key, value in rest.items())
    if isinstance(rest, (list, tuple)):
        return type(rest)(fill_sharded(value, tensors) for value in rest)
    return rest


def marker_paths(rest: Any) -> List[str]:
    """Every sharded tensor's path named by a marker in ``rest``."""
    if isinstance(rest, dict):
        if set(rest) == {MARKER_KEY}:
            return [rest[MARKER_KEY]]
        return [path for value in rest.values() for path in marker_paths(value)]
    if isinstance(rest, (list, tuple)):
        return [path for value in rest for path in marker_paths(value)]
    return []


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


class ShardedCheckpointer(DefaultCheckpointer):
    """Sharded, reshardable checkpoints for sharded strategies (``fsdp``); the trainer picks it
    when ``strategy.saves_sharded``.

    Same arguments and behaviour as :class:`DefaultCheckpointer` (``save_dir``, ``resume="auto"``,
    ``save_every_n_steps``, ``keep_last_n``/``keep_best_n``, ``async_save``, ``load_dir``,
    ``load_filename`` naming a checkpoint directory), but :meth:`save` is called on every rank
    and every rank writes its shards; see the module docstring for the layout and atomicity.
    Model exports (:meth:`save_model`) are the same single ``model-<index>.pt`` file as on
    ``sp``/``ddp``, written by rank zero from full weights.

    With ``async_save`` every rank copies its shards to CPU memory on the training thread and
    writes them on a background thread over a process group of its own (so its collectives
    never interleave with training's).

    Example:
        >>> checkpointer = ShardedCheckpointer(DefaultCheckpointerArguments(save_dir="/tmp/doc-sharded", resume="auto"))
        >>> checkpointer.saves_on_every_rank
        True
    """

    saves_on_every_rank = True

    def __init__(self, args: Optional[DefaultCheckpointerArguments] = None, default_dir: str = "outputs/checkpoints") -> None:
        super().__init__(args, default_dir)
        self._background_group: Any = None

    # -- saving ---------------------------------------------------------------------
    def save(self, checkpoint: Checkpoint, index: int, force: bool = False) -> Optional[str]:
        """Write ``checkpoint`` (call on every rank, with the same arguments)."""
        if not force and not self.is_epoch_save_due(index):
            return None
        self._wait_on_every_rank()
        name = sharded_checkpoint_name(checkpoint.global_step)
        score = checkpoint.metrics.get(self.args.metric)
        with self._lock:
            if score is not None:
                self._scores[name] = float(score)
            else:
                self._scores.pop(name, None)
        tensors, rest = split_sharded(checkpoint.to_dict())
        partial = storage.join(self._dir, f".{name}.partial")
        _on_rank_zero(lambda: self._fresh_directory(partial))
        if self.args.async_save:
            tensors = {key: _cpu_copy(tensor) for key, tensor in tensors.items()}
            rest = copy_to_cpu(rest)
            group = self._background_process_group()
            self._writer.submit(
                lambda: self._write_shards(name, partial, checkpoint.global_step, tensors, rest, group, agree=False)
            )
        else:
            self._write_shards(name, partial, checkpoint.global_step, tensors, rest, None, agree=True)
        return self._url(name)

    def _write_shards(
        self,
        name: str,
        partial: str,
        global_step: int,
        tensors: Dict[str, torch.Tensor],
        rest: Dict[str, Any],
        group: Any,
        agree: bool,
    ) -> None:
        with _single_process_quietly():
            dcp.save(tensors, storage_writer=_writer(self._fs, partial), process_group=group, no_dist=not _distributed())

        def finish() -> None:  # rank zero: DCP has gathered every rank's result, so every shard is written
            storage.write_atomically(self._fs, storage.join(partial, STATE_FILE), rest, serializer=self.serialize)
            final = storage.join(self._dir, name)
            if self._fs.exists(final):  # the same step saved again (e.g. the final save after a step save)
                self._fs.rm(final, recursive=True)
            self._fs.mv(partial, final, recursive=True)
            with self._fs.open(storage.join(final, COMPLETE_MARKER), "wb") as handle:
                handle.write(b"complete\n")
            logger.debug("wrote sharded checkpoint %s", self._url(name))
            self._apply_retention(global_step)

        try:
            if agree:
                _on_rank_zero(finish)
            elif _rank() == 0:
                finish()
        except BaseException:
            with self._lock:
                self._scores.pop(name, None)
            raise

    def _fresh_directory(self, path: str) -> None:
        if self._fs.exists(path):  # left by a run killed while saving this step
            self._fs.rm(path, recursive=True)
        self._fs.makedirs(path, exist_ok=True)

    def _background_process_group(self) -> Any:
        if self._background_group is None and _distributed():
            self._background_group = dist.new_group(backend="gloo")  # collective: every rank saves together
        return self._background_group

    def _wait_on_every_rank(self) -> None:
        """Wait for the save in flight; if it failed on any rank, raise on every rank."""
        error: Optional[BaseException] = None
        try:
            self._writer.wait()
        except BaseException as caught:
            error = caught
        if _distributed() and self.args.async_save:
            failures = [failure for failure in _all_gather(None if error is None else str(error)) if failure]
            if failures and error is None:
                raise RuntimeError(f"a background sharded checkpoint save failed on another rank: {failures[0]}")
        if error is not None:
            raise error

    # -- retention ------------------------------------------------------------------
    def _checkpoint_entries(self, fs: Any, directory: str) -> List[Tuple[int, str]]:
        """``(step, path)`` of the checkpoint directories in ``directory``, newest first."""
        fs.invalidate_cache(directory)
        if not fs.exists(directory):
            return []
        named = []
        for entry in fs.ls(directory, detail=True):
            match = _DIRECTORY_NAME.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if match and entry.get("type") == "directory":
                named.append((int(match.group(1)), entry["name"].rstrip("/")))
        return sorted(named, reverse=True)

    def _move_checkpoint(self, path: str, target: str) -> None:
        self._fs.mv(path, target, recursive=True)

    def _remove_checkpoint(self, path: str) -> None:
        self._fs.rm(path, recursive=True)

    # -- loading --------------------------------------------------------------------
    def load(self) -> Optional[Checkpoint]:
        """The checkpoint to resume from with full (unsharded) CPU tensors, or None; for tools and
        inspection (the trainer loads each rank's shards in place with :meth:`load_into`)."""
        return self._load(current=None, optimizers=())

    def load_into(self, current: Callable[[], Checkpoint], optimizers: Sequence[torch.optim.Optimizer]) -> Optional[Checkpoint]:
        """The checkpoint to resume from, read into the tensors of ``current()`` (this run's state,
        in its own sharding, whatever world size wrote the checkpoint), or None to start fresh.

        Call on every rank. Optimizers without state get theirs created first (see
        :func:`initialize_optimizer_state`); loading then overwrites it.
        """
        return self._load(current, optimizers)

    def _load(
        self, current: Optional[Callable[[], Checkpoint]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Optional[Checkpoint]:
        self.loaded_from, self.resumed_own_run = None, False
        sources: List[Tuple[str, bool]] = []  # (location, is a directory of checkpoints)
        if self.args.resume == "auto":
            sources.append((self.save_dir, True))
        if self.args.load_filename:
            sources.append((self.args.load_filename, False))
        elif self.args.load_dir:
            sources.append((self.args.load_dir, True))
        for source, is_directory in sources:
            checkpoint = (
                self._load_latest_into(source, current, optimizers) if is_directory else self._read(source, current, optimizers)
            )
            if checkpoint is None:
                continue
            if not is_directory:
                self.loaded_from = source
            directory = loaded_directory(self.loaded_from)
            self.resumed_own_run = storage.same_location(directory, self.save_dir)
            score = checkpoint.metrics.get(self.args.metric)
            if self.resumed_own_run and score is not None:
                with self._lock:
                    self._scores[sharded_checkpoint_name(checkpoint.global_step)] = float(score)
            return checkpoint
        if self.args.resume == "auto" or self.args.load_dir:
            logger.info("no checkpoint in %s: starting fresh", self.args.load_dir or self.save_dir)
        return None

    def _load_latest_into(self, source: str, current: Any, optimizers: Sequence[torch.optim.Optimizer]) -> Optional[Checkpoint]:
        # Any failure of a sharded directory (no marker, a short shard, DCP's own errors) counts as damaged.
        return self._load_latest(source, read=lambda url: self._read(url, current, optimizers), damaged=(Exception,))

    def read(self, url: str) -> Checkpoint:
        """Read the sharded checkpoint directory at ``url`` with full CPU tensors."""
        return self._read(url, None, ())

    def _read(
        self, url: str, current: Optional[Callable[[], Checkpoint]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Checkpoint:
        fs, path = storage.resolve(url)
        if not fs.isdir(path):
            raise FileNotFoundError(f"sharded checkpoint directory {url!r} does not exist")
        if not fs.exists(storage.join(path, COMPLETE_MARKER)):
            raise storage.CorruptCheckpoint(f"no {COMPLETE_MARKER} marker: the save did not finish")
        rest = storage.read(fs, storage.join(path, STATE_FILE), weights_only=self.args.weights_only)
        paths = marker_paths(rest)
        reader = _reader(fs, path)
        if current is None:  # full tensors, sized from the DCP index
            metadata = reader.read_metadata()
            targets = {}
            for key in paths:
                entry = metadata.state_dict_metadata[key]
                if not isinstance(entry, TensorStorageMetadata):
                    raise storage.CorruptCheckpoint(f"{key} is not a tensor in the checkpoint's index")
                targets[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
            with _single_process_quietly():
                dcp.load(targets, storage_reader=reader, no_dist=True)
        else:
            model_only = self.args.reset_optimizers_schedulers and not storage.same_location(
                url.rstrip("/").rsplit("/", 1)[0], self.save_dir
            )
            if not model_only and any(key.startswith("trainer/optimizers/") for key in paths):
                initialize_optimizer_state(optimizers)
            available, _ = split_sharded(current().to_dict())
            wanted = [key for key in paths if not (model_only and key.startswith("trainer/optimizers/"))]
            missing = [key for key in wanted if key not in available]
            if missing:
                raise ValueError(
                    f"the checkpoint holds tensors this run's module/optimizers do not have: {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''}; resume with the same model and optimizers"
                )
            targets = {key: available[key] for key in wanted}
            with _single_process_quietly():
                dcp.load(targets, storage_reader=reader, no_dist=not _distributed())
            targets.update({key: torch.empty(0) for key in paths if key not in targets})  # not restored
        checkpoint = Checkpoint.from_dict(fill_sharded(rest, targets))
        logger.info("loaded sharded checkpoint %s (epoch %d, step %d)", url, checkpoint.epoch, checkpoint.global_step)
        return checkpoint

    def resume_source(self) -> Optional[str]:
        if self.args.resume == "auto" and self._checkpoint_entries(self._fs, self._dir):
            return self.save_dir
        return self.args.load_filename or self.args.load_dir or None


def default_checkpointer(
    strategy: Any, given: Optional[AbstractCheckpointer], args: DefaultCheckpointerArguments, default_dir: str
) -> AbstractCheckpointer:
    """The checkpointer a trainer uses: ``given``, or a :class:`ShardedCheckpointer` when the
    strategy shards state (``strategy.saves_sharded``), else a :class:`DefaultCheckpointer`.

    Raises:
        ValueError: ``given`` writes on rank zero alone but the strategy shards state (rank zero
            does not hold the other ranks' shards).
    """
    sharded = bool(getattr(strategy, "saves_sharded", False))
    if given is not None:
        if sharded and not getattr(given, "saves_on_every_rank", False):
            raise ValueError(
                f"the {getattr(strategy, 'name', type(strategy).__name__)} strategy shards the model and optimizer "
                f"state over the ranks, so checkpoints must be written by every rank, and {type(given).__name__} "
                "writes on rank zero only; use framework.checkpoint.ShardedCheckpointer (or leave checkpointer unset)"
            )
        return given
    return (ShardedCheckpointer if sharded else DefaultCheckpointer)(args, default_dir=default_dir)


# -- process-group helpers (every rank calls them together) -------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _all_gather(obj: Any) -> List[Any]:
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _on_rank_zero(job: Callable[[], None]) -> None:
    """Run ``job`` on rank zero; every rank raises if it failed (the broadcast is also a barrier)."""
    failure = None
    if _rank() == 0:
        try:
            job()
        except Exception as error:
            failure = error
    if not _distributed():
        if failure is not None:
            raise failure
        return
    holder = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    dist.broadcast_object_list(holder, src=0)
    if failure is not None:
        raise failure
    if holder[0] is not None:
        raise RuntimeError(f"rank zero failed while saving a sharded checkpoint: {holder[0]}")


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's part that training may not change (a DTensor stays a DTensor)."""
    return tensor.detach().to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.detach().clone()


def _writer(fs: Any, path: str) -> Any:
    if _is_local(fs):
        return dcp.FileSystemWriter(path)
    from torch.distributed.checkpoint import FsspecWriter  # type: ignore[attr-defined]  # exported at runtime, not in the stubs

    return FsspecWriter(fs.unstrip_protocol(path))


def _reader(fs: Any, path: str) -> Any:
    if _is_local(fs):
        return dcp.FileSystemReader(path)
    from torch.distributed.checkpoint import FsspecReader  # type: ignore[attr-defined]  # exported at runtime, not in the stubs

    return FsspecReader(fs.unstrip_protocol(path))


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]
