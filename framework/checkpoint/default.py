"""DefaultCheckpointer: atomic checkpoint files in any fsspec directory, with retention."""

import collections
import logging
import re
import threading
import time
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, Type

import torch

from framework.checkpoint import storage
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.async_writer import BackgroundWriter
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.finite import best_first, first_non_finite_tensor, is_finite_score
from framework.checkpoint.plan import describe_checkpointing
from framework.run_directory import RunDirectoryInUse, ways_on

logger = logging.getLogger(__name__)

STALE_SUFFIX = ".stale"
"""Checkpoints newer than the one a resumed run writes are renamed ``<name>.stale`` (see ``save``)."""
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
_TEMPORARY = r"\.pt\.[0-9a-f]+" + re.escape(storage.TEMPORARY_SUFFIX) + "$"
_CHECKPOINT_TEMPORARY = re.compile(r"^\.checkpoint-\d+" + _TEMPORARY)
_ANY_TEMPORARY = re.compile(r"^\.(checkpoint|model)-\d+" + _TEMPORARY)
_RUN_FILE = re.compile(r"^(checkpoint|model)-\d+\.pt(" + re.escape(STALE_SUFFIX) + ")?$")


def checkpoint_name(global_step: int) -> str:
    """File name of the checkpoint taken after ``global_step`` optimizer steps."""
    return f"checkpoint-{global_step:09d}.pt"


def model_name(index: int) -> str:
    """File name of the model-only export taken after ``index`` optimizer steps."""
    return f"model-{index:09d}.pt"


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
    """Writes ``checkpoint-<step>.pt`` files into a local directory or any fsspec URL.

    Saving: every file is written to a temporary name and moved into place, so a crash
    never leaves a partial file under a checkpoint name (see :mod:`framework.checkpoint.storage`).
    With ``async_save`` the state is copied to CPU memory on the calling thread (into buffers
    kept from the previous save) and written on a background thread of lowered priority, one
    save at a time; a failed background write is raised by the next :meth:`save` or by
    :meth:`wait`.

    One run per directory: :meth:`prepare_run` (called by the trainer at setup, else by the
    first save) refuses a ``save_dir`` holding checkpoints of a run this one does not continue
    (:meth:`continues_existing_run`), so a new run never overwrites, deletes or renames
    another run's files.

    A checkpoint whose weights or ``metric`` hold NaN/inf is not written (a warning names the
    step) unless ``save_non_finite``.

    Retention runs after each write: checkpoints with a higher step than the one just
    written come from this run's own earlier attempt, later resumed from an older checkpoint,
    so they are renamed ``<name>.stale`` (never picked for resuming again); then, with
    ``keep_last_n`` set, only the newest ``keep_last_n`` plus the best ``keep_best_n`` by
    ``metric`` stay. A checkpoint is ranked by the value of ``metric`` recorded at its own step
    (e.g. the validation at that epoch end); checkpoints without one, or with NaN/inf, are
    never "best".

    Loading (:meth:`load`) takes the newest checkpoint that reads back: a truncated or
    damaged newer file is reported (path and reason, a logged warning) and skipped. A file
    that ``weights_only`` refuses, and a storage error that persists over retries, stop the
    load instead.

    Args:
        args: where, when and how many (see :class:`DefaultCheckpointerArguments`).
        default_dir: used when ``args.save_dir`` is None (the trainer passes
            ``<output_dir>/checkpoints``).

    Example:
        >>> checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir="memory://doc", resume="auto"))
        >>> checkpointer.save(Checkpoint({"model": {}}, {}, {}, global_step=5), index=1)
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
            parent = args.load_filename.rsplit("/", 1)[0] if "/" in args.load_filename else "."
            return storage.same_location(parent, self.save_dir)
        return False

    def prepare_run(self) -> None:
        """Refuse a ``save_dir`` holding another run's checkpoints; remove leftover temporary files.

        Runs once (the trainer calls it at setup; otherwise the first :meth:`save` or
        :meth:`save_model` does). Checkpoints, model exports and ``.stale`` files in ``save_dir``
        belong to another run unless :meth:`continues_existing_run`.

        Raises:
            RunDirectoryInUse: ``save_dir`` holds such files and this run does not continue them.
        """
        if self._prepared:
            return
        files = storage.list_files(self._fs, self._dir)
        names = sorted(_basename(path) for path in files)
        if not self.continues_existing_run():
            taken = [name for name in names if _RUN_FILE.match(name)]
            if taken:
                shown = ", ".join(taken[:4]) + (f", ... ({len(taken)} files)" if len(taken) > 4 else "")
                where = (
                    "output_dir (--trainer.output_dir)" if self.args.save_dir is None else "save_dir (--checkpointer.save_dir)"
                )
                raise RunDirectoryInUse(
                    f"save_dir {self.save_dir!r} already holds checkpoints of another run ({shown}) and this run does "
                    f"not resume it, so it would overwrite them; {ways_on(where)}"
                )
        for path in files:
            if _ANY_TEMPORARY.match(_basename(path)):  # left by a process killed while saving
                logger.info("removing %s, left by a save that did not finish", self._fs.unstrip_protocol(path))
                self._fs.rm(path)
        self._prepared = True

    # -- saving ---------------------------------------------------------------------
    def serialize(self, obj: Any, handle: IO[bytes]) -> None:
        """Write ``obj`` to the open binary ``handle`` (``torch.save``); override to change the encoding."""
        torch.save(obj, handle)

    def save(self, checkpoint: Checkpoint, index: int, force: bool = False) -> Optional[str]:
        if not force and not self.is_epoch_save_due(index):
            return None
        self.prepare_run()
        name = checkpoint_name(checkpoint.global_step)
        score = checkpoint.metrics.get(self.args.metric)
        busy_since = time.perf_counter() if self._writer.busy else None
        self._writer.wait()  # one save in flight at most; raises an earlier background failure
        if busy_since is not None and time.perf_counter() - busy_since > 0.5:
            logger.info(
                "checkpoint save waited %.1f s for the previous background write; save less often to avoid the wait",
                time.perf_counter() - busy_since,
            )
        problem = None if self.args.save_non_finite else self._non_finite(checkpoint)
        if problem is not None:
            logger.warning(
                "checkpoint at step %d not written: %s; the checkpoints before it are kept as they are "
                "(checkpointer_args.save_non_finite=True writes such checkpoints)",
                checkpoint.global_step,
                problem,
            )
            return None
        with self._lock:
            if score is not None:
                self._scores[name] = float(score)
            else:
                self._scores.pop(name, None)
        data = checkpoint.to_dict()
        if self.args.async_save:
            data = self._staging.copy(data)  # on this (the training) thread: training may change the originals next
            self._writer.submit(lambda: self._write(name, checkpoint.global_step, data))
        else:
            self._write(name, checkpoint.global_step, data)
        return self._url(name)

    def _non_finite(self, checkpoint: Checkpoint) -> Optional[str]:
        """What in ``checkpoint`` is NaN/inf (the monitored metric, then the weights), or None."""
        score = checkpoint.metrics.get(self.args.metric)
        if score is not None and not is_finite_score(score):
            return f"its {self.args.metric} is {score}"
        tensor = first_non_finite_tensor(checkpoint.module_state)
        if tensor is not None:
            return f"its weights hold NaN or inf (module state {tensor!r})"
        return None

    def _write(self, name: str, global_step: int, data: Dict[str, Any]) -> None:
        try:
            storage.write_atomically(self._fs, storage.join(self._dir, name), data, serializer=self.serialize)
        except BaseException:
            with self._lock:
                self._scores.pop(name, None)
            raise
        logger.debug("wrote checkpoint %s", self._url(name))
        self._apply_retention(global_step)

    def save_model(self, state: Dict[str, Any], index: int) -> Optional[str]:
        """Write ``state`` (the module's weights) to ``model-<index>.pt``; load it with
        ``torch.load(path, weights_only=True)``. Model exports are never removed by retention."""
        self.prepare_run()
        name = model_name(index)
        storage.write_atomically(self._fs, storage.join(self._dir, name), copy_to_cpu(state), serializer=self.serialize)
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
        """``(step, path)`` of the checkpoint files in ``directory``, newest (highest step) first."""
        named = []
        for path in storage.list_files(fs, directory):
            match = _CHECKPOINT_NAME.match(path.rsplit("/", 1)[-1])
            if match:
                named.append((int(match.group(1)), path))
        return sorted(named, reverse=True)

    def _checkpoint_files(self, directory: str) -> List[str]:
        """Checkpoint paths in ``directory`` (of ``save_dir``'s filesystem), newest first."""
        return [path for _, path in self._checkpoint_entries(self._fs, directory)]

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
                    path.rsplit("/", 1)[-1] + STALE_SUFFIX,
                )
                self._move_checkpoint(path, path + STALE_SUFFIX)
        paths = [path for step, path in entries if step <= written_step]
        for path in storage.list_files(self._fs, self._dir):
            if _CHECKPOINT_TEMPORARY.match(path.rsplit("/", 1)[-1]):  # left by a process killed while saving
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
                    self._remove_checkpoint(path)
                    self._scores.pop(_basename(path), None)

    def _move_checkpoint(self, path: str, target: str) -> None:
        """Rename one checkpoint (a file here; a directory in a sharded checkpointer)."""
        self._fs.mv(path, target)

    def _remove_checkpoint(self, path: str) -> None:
        """Delete one checkpoint (a file here; a directory in a sharded checkpointer)."""
        self._fs.rm(path)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``metric`` among those this run scored (NaN and inf
        never are), or None."""
        with self._lock:
            ranked = best_first(self._scores, self.args.mode)
        return self._url(ranked[0]) if ranked else None

    # -- loading --------------------------------------------------------------------
    def resume_source(self) -> Optional[str]:
        """The file or directory a run resumes from, per ``resume``/``load_filename``/``load_dir``.

        ``resume="auto"`` comes first when ``save_dir`` holds a checkpoint (a restarted run
        continues itself); otherwise ``load_filename``, then ``load_dir``.
        """
        if self.args.resume == "auto" and self._checkpoint_files(self._dir):
            return self.save_dir
        if self.args.load_filename:
            return self.args.load_filename
        if self.args.load_dir:
            return self.args.load_dir
        return None

    def load(self) -> Optional[Checkpoint]:
        """The checkpoint to resume from, or None to start fresh.

        Order: with ``resume="auto"``, the newest readable checkpoint in ``save_dir``; else
        ``load_filename``; else the newest readable checkpoint in ``load_dir``.

        Only damaged files (truncated, CRC mismatch) are skipped for an older checkpoint.

        Raises:
            CheckpointRefused: ``weights_only`` refuses a file (pickled objects, blocked modules,
                bytes before the archive); the run stops, the file is left as it is.
            OSError: listing or reading failed on every retry (EIO, permission).
            ValueError: a file is intact but not a checkpoint of this format or version.
            RuntimeError: the directory holds checkpoints but none of them reads back.
            FileNotFoundError / CorruptCheckpoint: ``load_filename`` is missing or unreadable.
        """
        self.loaded_from, self.resumed_own_run = None, False
        checkpoint: Optional[Checkpoint] = None
        if self.args.resume == "auto":
            checkpoint = self._load_latest(self.save_dir)
        if checkpoint is None and self.args.load_filename:
            checkpoint = self.read(self.args.load_filename)
            self.loaded_from = self.args.load_filename
        elif checkpoint is None and self.args.load_dir:
            checkpoint = self._load_latest(self.args.load_dir)
        if checkpoint is None:
            if self.args.resume == "auto" or self.args.load_dir:
                logger.info("no checkpoint in %s: starting fresh", self.args.load_dir or self.save_dir)
            return None
        directory = loaded_directory(self.loaded_from)
        self.resumed_own_run = storage.same_location(directory, self.save_dir)
        score = checkpoint.metrics.get(self.args.metric)
        if self.resumed_own_run and score is not None:
            with self._lock:
                self._scores[checkpoint_name(checkpoint.global_step)] = float(score)
        return checkpoint

    def _load_latest(
        self,
        source: str,
        read: Optional[Callable[[str], Checkpoint]] = None,
        damaged: Tuple[Type[BaseException], ...] = (storage.CorruptCheckpoint,),
    ) -> Optional[Checkpoint]:
        """The newest checkpoint in ``source`` that ``read`` (default :meth:`read`) reads back;
        reports and skips the ``damaged`` ones. A refused file stops the search."""
        fs, directory = storage.resolve(source)
        entries = self._checkpoint_entries(fs, directory)
        failures = []
        for _, path in entries:
            url = fs.unstrip_protocol(path)
            try:
                checkpoint = (read or self.read)(url)
            except storage.CheckpointRefused:
                raise
            except damaged as error:  # truncated or damaged: only these fall back
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
        """Read and check the checkpoint file at ``url`` (path or fsspec URL)."""
        fs, path = storage.resolve(url)
        try:
            data = storage.read(fs, path, weights_only=self.args.weights_only)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"checkpoint file {url!r} does not exist") from error
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
    def get_state(self) -> Dict[str, Any]:
        with self._lock:
            return {"scores": dict(self._scores), "save_dir": self.save_dir}

    def update_state(self, state: Dict[str, Any]) -> None:
        saved_dir = state.get("save_dir")
        if saved_dir is not None and not storage.same_location(saved_dir, self.save_dir):
            return  # scores name files of another directory
        with self._lock:
            self._scores.update(state.get("scores", {}))


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def loaded_directory(loaded_from: Optional[str]) -> str:
    """The directory of the checkpoint (file or sharded directory) just loaded from ``loaded_from``."""
    if loaded_from is None:
        raise RuntimeError("a checkpoint was loaded without recording where from")
    path = loaded_from.rstrip("/")
    return path.rsplit("/", 1)[0] if "/" in path else "."
