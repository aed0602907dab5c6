"""DefaultCheckpointer: when and where checkpoints are written, which are kept, which one a run
resumes from, for every backend (the strategy writes and reads each checkpoint)."""

import collections
import logging
import re
import threading
import time
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from backends.strategies import SingleProcess, Strategy
from framework.checkpoint import storage
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.async_writer import BackgroundWriter
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.file_io import FileIO
from framework.checkpoint.finite import best_first, first_non_finite_tensor, is_finite_score
from framework.checkpoint.plan import describe_checkpointing
from framework.run.run_directory import RUN_ENTRY, RunDirectoryInUse, ways_on

logger = logging.getLogger(__name__)

STALE_SUFFIX = ".stale"
"""Checkpoints newer than the one a resumed run writes are renamed ``<name>.stale`` (see ``save``)."""
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(\.pt)?$")  # a file, or a directory of shards
_TEMPORARY = r"\.pt\.[0-9a-f]+" + re.escape(storage.TEMPORARY_SUFFIX) + "$"
_CHECKPOINT_TEMPORARY = re.compile(r"^\.checkpoint-\d+" + _TEMPORARY)
_ANY_TEMPORARY = re.compile(r"^\.(checkpoint|model)-\d+(" + _TEMPORARY + r"|\.partial$)")  # files; sharded: directories


def checkpoint_name(global_step: int, suffix: str = ".pt") -> str:
    """Name of the checkpoint taken after ``global_step`` optimizer steps (``suffix``: the
    strategy's ``checkpoint_suffix``; ``""`` names a directory of shards)."""
    return f"checkpoint-{global_step:09d}{suffix}"


def model_name(step: int) -> str:
    """File name of the model-only export taken after ``step`` optimizer steps."""
    return f"model-{step:09d}.pt"


def copy_to_cpu(obj: Any, _memo: Optional[Dict[int, torch.Tensor]] = None) -> Any:
    """A copy of ``obj`` whose tensors are fresh CPU tensors (safe to write while training goes on).

    Dicts, lists and tuples are rebuilt, so later in-place changes to the originals do not
    reach the copy; a tensor that appears twice is copied once.

    Example:
        >>> weights = torch.ones(2)
        >>> copy = copy_to_cpu({"w": weights})
        >>> _ = weights.add_(1)
        >>> copy["w"]
        tensor([1., 1.])
    """
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        copied = {key: copy_to_cpu(value, memo) for key, value in obj.items()}
        return collections.OrderedDict(copied) if isinstance(obj, collections.OrderedDict) else copied
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(copy_to_cpu(value, memo) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(value, memo) for value in obj)
    return obj


class StagingBuffers:
    """CPU copies of a state for asynchronous saves, reusing the previous save's buffers.

    Reusing buffers of the same shape and dtype avoids allocating (and page-faulting) the
    whole checkpoint again at every save; buffers are pinned when the source is on a GPU,
    so the device-to-host copies run asynchronously and are awaited once. Only safe when
    the write of the previous copy has finished (the checkpointer waits for it first).

    Example:
        >>> staging = StagingBuffers()
        >>> weights = torch.ones(2)
        >>> first = staging.copy({"w": weights})
        >>> second = staging.copy({"w": weights * 2})
        >>> second["w"].data_ptr() == first["w"].data_ptr(), second["w"]
        (True, tensor([2., 2.]))
    """

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        """``obj`` with every tensor copied into a CPU buffer (containers rebuilt)."""
        used: Dict[Tuple[Any, ...], torch.Tensor] = {}
        memo: Dict[int, torch.Tensor] = {}
        result = self._copy(obj, (), used, memo)
        self._buffers = used
        if any(buffer.is_pinned() for buffer in used.values()):
            torch.cuda.synchronize()
        return result

    def _copy(
        self, obj: Any, path: Tuple[Any, ...], used: Dict[Tuple[Any, ...], torch.Tensor], memo: Dict[int, torch.Tensor]
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo:
                return memo[id(obj)]
            source = obj.detach()
            if source.layout != torch.strided or source.is_quantized or type(source) is not torch.Tensor:
                copied = source.to("cpu", copy=True)
            else:
                buffer = self._buffers.get(path)
                if (
                    buffer is None
                    or buffer.shape != source.shape
                    or buffer.dtype != source.dtype
                    or buffer.stride() != source.stride()
                ):
                    pin = source.is_cuda and torch.cuda.is_available()
                    buffer = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, pin_memory=pin)
                buffer.copy_(source, non_blocking=source.is_cuda)
                used[path] = copied = buffer
            memo[id(obj)] = copied
            return copied
        if isinstance(obj, dict):
            copied_dict = {key: self._copy(value, (*path, key), used, memo) for key, value in obj.items()}
            return collections.OrderedDict(copied_dict) if isinstance(obj, collections.OrderedDict) else copied_dict
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self._copy(value, (*path, index), used, memo) for index, value in enumerate(obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, (*path, index), used, memo) for index, value in enumerate(obj))
        return obj


class DefaultCheckpointer(AbstractCheckpointer):
    """Saves ``checkpoint-<step>`` into a local directory or any fsspec URL, keeps the newest
    and the best, and resumes from the newest that reads back, on every backend.

    The strategy writes and reads each checkpoint (``sp``/``ddp``: one file
    ``checkpoint-<step>.pt`` from rank zero; ``fsdp``: a directory ``checkpoint-<step>/`` of
    shards from every rank, see :mod:`backends.sharded_checkpoint`); this class decides the
    rest, the same way for all of them:

    Saving: every file is written to a temporary name (a sharded checkpoint to a ``.partial``
    directory) and moved into place, so a crash never leaves a partial checkpoint under a
    checkpoint name (see :mod:`framework.checkpoint.storage`). With ``async_save`` the state is
    copied to CPU memory on the calling thread (into buffers kept from the previous save) and
    written on a background thread of lowered priority, one save at a time; a failed
    background write is raised, on every rank, by the next :meth:`save` (or by :meth:`wait`).

    One run per directory: :meth:`prepare_run` (called by the trainer at setup, else by the
    first save) refuses a ``save_dir`` holding checkpoints (files or directories) of a run this
    one does not continue (:meth:`continues_existing_run`), so a new run never overwrites,
    deletes or renames another run's files.

    A checkpoint whose weights (on any rank's shard) or ``metric`` hold NaN/inf is not written
    (a warning names the step) unless ``save_non_finite``.

    Retention runs after each write: checkpoints with a higher step than the one just
    written come from this run's own earlier attempt, later resumed from an older checkpoint,
    so they are renamed ``<name>.stale`` (never picked for resuming again); then, with
    ``keep_last_n`` set, only the newest ``keep_last_n`` plus the best ``keep_best_n`` by
    ``metric`` stay. A checkpoint is ranked by the value of ``metric`` recorded at its own step
    (e.g. the validation at that epoch end); checkpoints without one, or with NaN/inf, are
    never "best".

    Loading (:meth:`load`) takes the newest checkpoint that reads back: a truncated or
    damaged newer one (a short file, a missing shard, an index that is not the one written
    with it) is reported (path and reason, a logged warning) and skipped. A file that
    ``weights_only`` refuses, and a storage error that persists over retries, stop the load
    instead.

    Args:
        args: where, when and how many (see :class:`DefaultCheckpointerArguments`).
        default_dir: used when ``args.save_dir`` is None (the trainer passes
            ``<output_dir>/checkpoints``).

    Example:
        >>> checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir="memory://doc", resume="auto"))
        >>> checkpointer.save(Checkpoint({"model": {}}, {}, {}, global_step=5), epoch=1)
        'memory://doc/checkpoint-000000005.pt'
        >>> checkpointer.load().global_step
        5
    """

    def __init__(self, args: Optional[DefaultCheckpointerArguments] = None, default_dir: str = "outputs/checkpoints") -> None:
        if args is not None and not isinstance(args, DefaultCheckpointerArguments):
            raise TypeError(f"args must be DefaultCheckpointerArguments or None, got {type(args).__name__}")
        self.args = args if args is not None else DefaultCheckpointerArguments()
        self.save_dir = str(self.args.save_dir or default_dir)
        self._fs, self._dir = storage.resolve(self.save_dir)
        self._scores: Dict[str, float] = {}
        self._lock = threading.Lock()  # _scores is changed by the training and the writer thread
        self._writer = BackgroundWriter()
        self._staging = StagingBuffers()
        self._io = FileIO(serialize=self.serialize, weights_only=self.args.weights_only, stage=self._staging.copy)
        self.loaded_from: Optional[str] = None
        """URL of the checkpoint the last :meth:`load` returned."""
        self.resumed_own_run = False
        """True when the last :meth:`load` took a checkpoint from ``save_dir`` (a restart of this run)."""
        self._prepared = False

    # -- one run per directory ----------------------------------------------------------
    def continues_existing_run(self) -> bool:
        """True with ``resume="auto"``, or when ``load_dir`` is ``save_dir`` or ``load_filename`` lies in it."""
        args = self.args
        if args.resume == "auto":
            return True
        if args.load_dir and storage.same_location(args.load_dir, self.save_dir):
            return True
        if args.load_filename:
            return storage.same_location(loaded_directory(args.load_filename), self.save_dir)
        return False

    def prepare_run(self) -> None:
        """Refuse a ``save_dir`` holding another run's checkpoints; remove leftovers of killed saves.

        Runs once, on rank zero (the trainer calls it at setup; otherwise the first :meth:`save`
        or :meth:`save_model` does). Checkpoints (files or directories), model exports and
        ``.stale`` ones in ``save_dir`` belong to another run unless :meth:`continues_existing_run`.

        Raises:
            RunDirectoryInUse: ``save_dir`` holds such checkpoints and this run does not continue them.
        """
        if self._prepared:
            return
        entries = storage.list_entries(self._fs, self._dir)
        if not self.continues_existing_run():
            taken = sorted(_basename(path) for path in entries if RUN_ENTRY.match(_basename(path)))
            if taken:
                shown = ", ".join(taken[:4]) + (f", ... ({len(taken)} checkpoints)" if len(taken) > 4 else "")
                where = (
                    "output_dir (--trainer.output_dir)" if self.args.save_dir is None else "save_dir (--checkpointer.save_dir)"
                )
                raise RunDirectoryInUse(
                    f"save_dir {self.save_dir!r} already holds checkpoints of another run ({shown}) and this run does "
                    f"not resume it, so it would overwrite them; {ways_on(where)}"
                )
        for path in entries:
            if _ANY_TEMPORARY.match(_basename(path)):  # left by a process killed while saving
                logger.info("removing %s, left by a save that did not finish", self._fs.unstrip_protocol(path))
                self._fs.rm(path, recursive=True)
        self._prepared = True

    # -- saving ---------------------------------------------------------------------
    def serialize(self, obj: Any, handle: IO[bytes]) -> None:
        """Write ``obj`` to the open binary ``handle`` (``torch.save``); override to change the encoding."""
        torch.save(obj, handle)

    def save(self, checkpoint: Checkpoint, epoch: int, force: bool = False) -> Optional[str]:
        """Write ``checkpoint`` if a save is due after ``epoch`` epochs finished (or ``force``);
        return where it went, or None when it was not due or not written (NaN). Call on every rank, with the same arguments:
        every rank raises when the write failed on any rank."""
        if not force and not self.is_epoch_save_due(epoch):
            return None
        strategy = self.strategy
        if strategy.is_main_process:
            self.prepare_run()
        name = checkpoint_name(checkpoint.global_step, strategy.checkpoint_suffix)
        self._wait_on_every_rank()  # one save in flight at most
        problem = None if self.args.save_non_finite else self._non_finite(checkpoint)
        problems = [(rank, found) for rank, found in enumerate(strategy.all_gather_object(problem)) if found]
        if problems:
            rank, found = problems[0]
            where = "" if strategy.world_size == 1 else f" on rank {rank}"
            logger.warning(
                "checkpoint at step %d not written: %s%s; the checkpoints before it are kept as they are "
                "(checkpointer_args.save_non_finite=True writes such checkpoints)",
                checkpoint.global_step,
                found,
                where,
            )
            return None
        score = checkpoint.metrics.get(self.args.metric)
        with self._lock:
            if score is not None:
                self._scores[name] = float(score)
            else:
                self._scores.pop(name, None)
        write = strategy.save_checkpoint(self._url(name), checkpoint.to_dict(), self._io, copy=self.args.async_save)

        def job() -> None:
            try:
                write()
            except BaseException:
                with self._lock:
                    self._scores.pop(name, None)
                raise
            if strategy.is_main_process:
                logger.debug("wrote checkpoint %s", self._url(name))
                self._apply_retention(checkpoint.global_step)

        if self.args.async_save:
            self._writer.submit(job)
        else:
            error = None
            try:
                job()
            except Exception as caught:  # raised on every rank below
                error = caught
            strategy.raise_if_any_failed(error, "save a checkpoint")
        return self._url(name)

    def _wait_on_every_rank(self) -> None:
        """Wait for the save in flight; if it failed on any rank, raise on every rank."""
        busy_since = time.perf_counter() if self._writer.busy else None
        error = None
        try:
            self._writer.wait()
        except Exception as caught:
            error = caught
        if busy_since is not None and time.perf_counter() - busy_since > 0.5:
            logger.info(
                "checkpoint save waited %.1f s for the previous background write; save less often to avoid the wait",
                time.perf_counter() - busy_since,
            )
        if self.args.async_save:
            self.strategy.raise_if_any_failed(error, "write a checkpoint in the background")
        elif error is not None:
            raise error

    def _non_finite(self, checkpoint: Checkpoint) -> Optional[str]:
        """What in ``checkpoint`` is NaN/inf (the monitored metric, then this rank's weights), or None."""
        score = checkpoint.metrics.get(self.args.metric)
        if score is not None and not is_finite_score(score):
            return f"its {self.args.metric} is {score}"
        tensor = first_non_finite_tensor(self.strategy.local_shards(checkpoint.module_state))
        if tensor is not None:
            return f"its weights hold NaN or inf (module state {tensor!r})"
        return None

    def save_model(self, state: Dict[str, Any], step: int) -> Optional[str]:
        """Write ``state`` (the module's full weights) to ``model-<step>.pt`` (call on rank zero);
        load it with ``torch.load(path, weights_only=True)``. Model exports are never removed by retention."""
        self.prepare_run()
        name = model_name(step)
        self._io.write(self._url(name), copy_to_cpu(state))
        return self._url(name)

    def is_epoch_save_due(self, epochs_finished: int) -> bool:
        return bool(self.args.period) and epochs_finished % self.args.period == 0

    def is_step_save_due(self, global_step: int) -> bool:
        every = self.args.save_every_n_steps
        if not every:
            return False
        return global_step % every == 0

    def wait(self) -> None:
        self._writer.wait()

    def _url(self, name: str) -> str:
        return storage.join(self.save_dir, name)

    # -- retention ------------------------------------------------------------------
    def _checkpoint_entries(self, fs: Any, directory: str) -> List[Tuple[int, str]]:
        """``(step, path)`` of the checkpoints (files or directories) in ``directory``, newest first."""
        named = []
        for path in storage.list_entries(fs, directory):
            match = _CHECKPOINT_NAME.match(_basename(path))
            if match:
                named.append((int(match.group(1)), path))
        return sorted(named, reverse=True)

    def _apply_retention(self, written_step: int) -> None:
        entries = self._checkpoint_entries(self._fs, self._dir)
        for step, path in entries:
            if step > written_step:
                logger.warning(
                    "checkpoint %s is newer (step %d) than the one this run just wrote (step %d): it was written before "
                    "this run was resumed from an older checkpoint; renamed to %s so it is never resumed from",
                    self._fs.unstrip_protocol(path),
                    step,
                    written_step,
                    _basename(path) + STALE_SUFFIX,
                )
                self._fs.mv(path, path + STALE_SUFFIX, recursive=True)
        paths = [path for step, path in entries if step <= written_step]
        for path in storage.list_files(self._fs, self._dir):
            if _CHECKPOINT_TEMPORARY.match(_basename(path)):  # left by a process killed while saving
                self._fs.rm(path)
        if self.args.keep_last_n is None:
            return
        keep = set(paths[: self.args.keep_last_n])
        with self._lock:
            if self.args.keep_best_n:
                present = {_basename(path): path for path in paths}
                scores = {name: score for name, score in self._scores.items() if name in present}
                keep.update(present[name] for name in best_first(scores, self.args.mode)[: self.args.keep_best_n])
            for path in paths:
                if path not in keep:
                    self._fs.rm(path, recursive=True)
                    self._scores.pop(_basename(path), None)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``metric`` among those this run scored (NaN and inf
        never are), or None."""
        with self._lock:
            ranked = best_first(self._scores, self.args.mode)
        return self._url(ranked[0]) if ranked else None

    # -- loading --------------------------------------------------------------------
    def resume_source(self) -> Optional[str]:
        """The checkpoint or directory a run resumes from, per ``resume``/``load_filename``/``load_dir``.

        ``resume="auto"`` comes first when ``save_dir`` holds a checkpoint (a restarted run
        continues itself); otherwise ``load_filename``, then ``load_dir``.
        """
        if self.args.resume == "auto" and self._checkpoint_entries(self._fs, self._dir):
            return self.save_dir
        return self.args.load_filename or self.args.load_dir or None

    def load(self) -> Optional[Checkpoint]:
        """The checkpoint to resume from (full tensors, whatever wrote it), or None to start fresh.

        Order: with ``resume="auto"``, the newest readable checkpoint in ``save_dir``; else
        ``load_filename``; else the newest readable checkpoint in ``load_dir``.

        Only damaged checkpoints (truncated, CRC mismatch, a missing shard, an index that is
        not the one written with it) are skipped for an older one.

        Raises:
            CheckpointRefused: ``weights_only`` refuses a file (pickled objects, blocked modules,
                bytes before the archive, a sharded index without its digest); the run stops,
                the file is left as it is.
            OSError: listing or reading failed on every retry (EIO, permission).
            ValueError: a checkpoint is intact but not of this format or version.
            RuntimeError: the directory holds checkpoints but none of them reads back.
            FileNotFoundError / CorruptCheckpoint: ``load_filename`` is missing or unreadable.
        """
        return self._load(None, ())

    def load_into(self, current: Callable[[], Checkpoint], optimizers: Sequence[torch.optim.Optimizer]) -> Optional[Checkpoint]:
        """As :meth:`load`, read through the strategy into ``current()``'s tensors (``fsdp``: each
        rank its own shards, any world size wrote them); call on every rank."""
        return self._load(current, optimizers)

    def _load(
        self, current: Optional[Callable[[], Checkpoint]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Optional[Checkpoint]:
        self.loaded_from, self.resumed_own_run = None, False

        def read(url: str) -> Checkpoint:
            return self._read(url, current, optimizers)

        checkpoint: Optional[Checkpoint] = None
        if self.args.resume == "auto":
            checkpoint = self._load_latest(self.save_dir, read)
        if checkpoint is None and self.args.load_filename:
            checkpoint = read(self.args.load_filename)
            self.loaded_from = self.args.load_filename
        elif checkpoint is None and self.args.load_dir:
            checkpoint = self._load_latest(self.args.load_dir, read)
        if checkpoint is None:
            if self.args.resume == "auto" or self.args.load_dir:
                logger.info("no checkpoint in %s: starting fresh", self.args.load_dir or self.save_dir)
            return None
        self.resumed_own_run = storage.same_location(loaded_directory(self.loaded_from), self.save_dir)
        score = checkpoint.metrics.get(self.args.metric)
        if self.resumed_own_run and score is not None:
            with self._lock:
                self._scores[checkpoint_name(checkpoint.global_step, self.strategy.checkpoint_suffix)] = float(score)
        return checkpoint

    def _load_latest(self, source: str, read: Callable[[str], Checkpoint]) -> Optional[Checkpoint]:
        """The newest checkpoint in ``source`` that ``read`` reads back; reports and skips the
        damaged ones. A refused one stops the search."""
        fs, directory = storage.resolve(source)
        failures = []
        for _, path in self._checkpoint_entries(fs, directory):
            url = fs.unstrip_protocol(path)
            try:
                checkpoint = read(url)
            except storage.CheckpointRefused:
                raise
            except storage.CorruptCheckpoint as error:  # truncated or damaged: only these fall back
                logger.warning("checkpoint %s is unreadable and was skipped: %s", url, error)
                failures.append(f"{url}: {error}")
                continue
            if failures:
                logger.warning("resuming from the newest readable checkpoint %s instead", url)
            self.loaded_from = url
            return checkpoint
        if failures:
            raise RuntimeError(
                f"{source} holds {len(failures)} checkpoint(s) and none reads back, so the run cannot resume; "
                f"move them away to start fresh. " + "; ".join(failures)
            )
        return None

    def read(self, url: str) -> Checkpoint:
        """Read and check the checkpoint at ``url`` (path or fsspec URL; a file, or a sharded
        directory read with full tensors), in this process alone."""
        return self._read(url, None, ())

    def _read(
        self, url: str, current: Optional[Callable[[], Checkpoint]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Checkpoint:
        model_only = self.args.reset_optimizers_schedulers and not storage.same_location(loaded_directory(url), self.save_dir)
        if current is None:  # whole, in this process: no collective
            data = SingleProcess().load_checkpoint(url, self._io)
        else:
            data = self.strategy.load_checkpoint(
                url, self._io, target=lambda: current().to_dict(), optimizers=() if model_only else optimizers
            )
        try:
            checkpoint = Checkpoint.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{url}: {error}") from error
        logger.info("loaded checkpoint %s (epoch %d, step %d)", url, checkpoint.epoch, checkpoint.global_step)
        return checkpoint

    def saves_at_end(self) -> bool:
        return self.args.save_at_end

    def describe(self) -> Optional[str]:
        return describe_checkpointing(self.args, self.save_dir)

    def resumed_automatically(self) -> bool:
        """True when ``resume="auto"`` found the loaded checkpoint in ``save_dir`` (checked first)."""
        return self.args.resume == "auto" and self.resumed_own_run

    def restores_model_only(self) -> bool:
        """True with ``reset_optimizers_schedulers``, unless :meth:`load` resumed this run's own checkpoint."""
        return self.args.reset_optimizers_schedulers and not self.resumed_own_run

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        with self._lock:
            return {"scores": dict(self._scores), "save_dir": self.save_dir}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved_dir = state.get("save_dir")
        if saved_dir is not None and not storage.same_location(saved_dir, self.save_dir):
            return  # scores name files of another directory
        with self._lock:
            self._scores.update(state.get("scores", {}))


def default_checkpointer(
    strategy: Strategy, given: Optional[AbstractCheckpointer], args: DefaultCheckpointerArguments, default_dir: str
) -> AbstractCheckpointer:
    """The checkpointer a trainer uses (``given``, else a :class:`DefaultCheckpointer` from
    ``args``), told which strategy writes and reads its checkpoints."""
    checkpointer = given if given is not None else DefaultCheckpointer(args, default_dir=default_dir)
    checkpointer.setup(strategy)
    return checkpointer


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def loaded_directory(loaded_from: Optional[str]) -> str:
    """The directory of the checkpoint (file or sharded directory) at ``loaded_from``."""
    if loaded_from is None:
        raise RuntimeError("a checkpoint was loaded without recording where from")
    path = loaded_from.rstrip("/")
    return path.rsplit("/", 1)[0] if "/" in path else "."
