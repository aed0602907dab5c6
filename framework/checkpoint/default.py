"""DefaultCheckpointer: when and where checkpoints are written, which are kept, which one a run
resumes from, for every backend (the strategy writes and reads each checkpoint)."""

import difflib
import logging
import time
from typing import IO, Any, Callable, Dict, List, Optional, Sequence

import torch

from backends.checkpoint_io import run_files
from backends.strategies import SingleProcess, Strategy
from framework.checkpoint import storage
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.async_writer import BackgroundWriter
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.file_io import FileIO
from framework.checkpoint.finite import first_non_finite_tensor, is_finite_score
from framework.checkpoint.plan import describe_checkpointing
from framework.checkpoint.resume import load_latest, loaded_directory
from framework.checkpoint.retention import (
    ANY_TEMPORARY,
    STALE_SUFFIX,
    CheckpointScores,
    apply_retention,
    basename,
    check_name_agrees,
    checkpoint_entries,
    checkpoint_name,
    model_name,
    remember_run_id,
)
from framework.checkpoint.staging import StagingBuffers, copy_to_cpu
from framework.checkpoint.storage_check import check_storage_serves
from framework.run.run_directory import RUN_ENTRY, RunDirectoryInUse, ways_on

logger = logging.getLogger(__name__)

__all__ = [  # names tests and other modules import from here
    "STALE_SUFFIX",
    "DefaultCheckpointer",
    "checkpoint_name",
    "copy_to_cpu",
    "default_checkpointer",
    "loaded_directory",
    "model_name",
]


class DefaultCheckpointer(AbstractCheckpointer):
    """Saves ``checkpoint-<step>`` into a local directory or any fsspec URL, keeps the newest
    and the best, and resumes from the newest that reads back, on every backend.

    The strategy writes and reads each checkpoint (``sp``/``ddp``: one file
    ``checkpoint-<step>.pt`` from rank zero; ``fsdp``: a directory ``checkpoint-<step>/`` of
    shards from every rank, see :mod:`backends.checkpoint_io.sharded_checkpoint`); this class decides the
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

    save_dir: str  # always a directory: save_dir, or output_dir/checkpoints

    def __init__(self, args: Optional[DefaultCheckpointerArguments] = None, default_dir: str = "outputs/checkpoints") -> None:
        if args is not None and not isinstance(args, DefaultCheckpointerArguments):
            raise TypeError(f"args must be DefaultCheckpointerArguments or None, got {type(args).__name__}")
        self.args = args if args is not None else DefaultCheckpointerArguments()
        self.save_dir = str(self.args.save_dir or default_dir)
        self.weights_only, self.metric, self.mode = self.args.weights_only, self.args.metric, self.args.mode
        self._fs, self._dir = storage.resolve(self.save_dir)
        self._scores = CheckpointScores()  # changed by the training and the writer thread
        self._writer = BackgroundWriter()
        self._staging = StagingBuffers()
        self._io = FileIO(serialize=self.serialize, weights_only=self.args.weights_only, stage=self._staging.copy)
        self.loaded_from: Optional[str] = None
        """URL of the checkpoint the last :meth:`load` returned."""
        self.resumed_own_run = False
        """True when the last :meth:`load` took a checkpoint from ``save_dir`` (a restart of this run)."""
        self._prepared = False
        self._metric_seen = False

    def setup(self, strategy: Strategy) -> None:
        """Told which strategy writes and reads; refuses storage its processes cannot share (``memory://``)."""
        super().setup(strategy)
        locations = {"save_dir": self.save_dir, "load_dir": self.args.load_dir, "load_filename": self.args.load_filename}
        check_storage_serves(strategy.world_size, strategy.name, locations, shards=getattr(strategy, "shards_parameters", False))

    # -- one run per directory ----------------------------------------------------------
    def use_default_dir(self, default_dir: str) -> None:
        """Write to ``default_dir`` instead of the one given at construction, unless ``save_dir`` is
        set (the trainer calls it before the run starts when the run moves to ``version_<N>``)."""
        if self.args.save_dir is None and not self._prepared:
            self.save_dir = str(default_dir)
            self._fs, self._dir = storage.resolve(self.save_dir)

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
            taken = sorted(basename(path) for path in entries if RUN_ENTRY.match(basename(path)))
            if taken:
                shown = ", ".join(taken[:4]) + (f", ... ({len(taken)} checkpoints)" if len(taken) > 4 else "")
                where = (
                    "output_dir (--trainer.output_dir)" if self.args.save_dir is None else "save_dir (--checkpointer.save_dir)"
                )
                raise RunDirectoryInUse(
                    f"save_dir {self.save_dir!r} already holds checkpoints of another run ({shown}) and this run does "
                    f"not resume it, so it would overwrite them; {ways_on(where)}"
                )
        for path in entries:  # a temporary naming a run is left to that run's retention (which knows its id)
            if ANY_TEMPORARY.match(basename(path)) and storage.temporary_run_id(basename(path)) is None:
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
        self._check_metric(checkpoint.metrics, checkpoint.global_step)
        self._scores.record(name, checkpoint.metrics.get(self.args.metric))
        run_id = checkpoint.trainer_state.get("run_id") if isinstance(checkpoint.trainer_state, dict) else None
        with storage.temporaries_of(run_id):  # its temporary names carry the run id: cleanups know whose they are
            write = strategy.save_checkpoint(self._url(name), checkpoint.to_dict(), self._io, copy=self.args.async_save)

        def job() -> None:
            try:
                with storage.temporaries_of(run_id):
                    write()
            except BaseException:
                self._scores.forget(name)
                raise
            if strategy.is_main_process:
                logger.debug("wrote checkpoint %s", self._url(name))
                args = self.args
                step, scores = checkpoint.global_step, self._scores
                remember_run_id(self._fs, storage.join(self._dir, name), run_id)  # never read back to learn it
                apply_retention(self._fs, self._dir, step, scores, args.keep_last_n, args.keep_best_n, args.mode, run_id)

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

    def _check_metric(self, metrics: Dict[str, float], step: int) -> None:
        """Refuse a ``metric`` never recorded once metrics of its kind (``val_...``) are: it would rank nothing."""
        metric = self.args.metric
        if self._metric_seen or metric in metrics:
            self._metric_seen = self._metric_seen or metric in metrics
            return
        if not self.args.keep_best_n and metric == DefaultCheckpointerArguments.metric:
            return  # the default, and nothing kept by it
        kind = metric.split("_", 1)[0] + "_"
        recorded = sorted(name for name in metrics if name.startswith(kind))
        if recorded:
            close = difflib.get_close_matches(metric, recorded, n=1)
            raise ValueError(
                f"checkpointer_args.metric={metric!r} is not recorded: the validation at step {step} recorded "
                f"{recorded}{f' (did you mean {close[0]!r}?)' if close else ''}; no checkpoint could be ranked by it "
                "(--checkpointer.metric NAME)"
            )

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
    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``metric`` among those this run scored (NaN and inf
        never are), or None."""
        best = self._scores.best(self.args.mode)
        return None if best is None else self._url(best)

    # -- loading --------------------------------------------------------------------
    def resume_source(self) -> Optional[str]:
        """The checkpoint or directory a run resumes from, per ``resume``/``load_filename``/``load_dir``.

        ``resume="auto"`` comes first when ``save_dir`` holds a checkpoint (a restarted run
        continues itself); otherwise ``load_filename``, then ``load_dir``.
        """
        if self.args.resume == "auto" and checkpoint_entries(self._fs, self._dir):
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
                bytes before the archive, a sharded index naming other globals); the run stops,
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

        gather = None if current is None else self.strategy.all_gather_object  # every rank reads: they agree
        checkpoint: Optional[Checkpoint] = None
        if self.args.resume == "auto":
            checkpoint = self._load_latest(self.save_dir, read, gather)
        if checkpoint is None and self.args.load_filename:
            checkpoint = read(run_files.named_by_user(self.args.load_filename))
            self.loaded_from = self.args.load_filename
        elif checkpoint is None and self.args.load_dir:
            checkpoint = self._load_latest(self.args.load_dir, read, gather)
        if checkpoint is None:
            if self.args.resume == "auto" or self.args.load_dir:
                logger.info("no checkpoint in %s: starting fresh", self.args.load_dir or self.save_dir)
            return None
        self.resumed_own_run = storage.same_location(loaded_directory(self.loaded_from), self.save_dir)
        if self.resumed_own_run and self.loaded_from is not None:  # whose it is, known: retention does not read it again
            saved_id = checkpoint.trainer_state.get("run_id") if isinstance(checkpoint.trainer_state, dict) else None
            remember_run_id(self._fs, storage.join(self._dir, basename(self.loaded_from)), saved_id)
        score = checkpoint.metrics.get(self.args.metric)
        if self.resumed_own_run and score is not None:
            self._scores.record(checkpoint_name(checkpoint.global_step, self.strategy.checkpoint_suffix), score)
        return checkpoint

    def _load_latest(
        self, source: str, read: Callable[[str], Checkpoint], gather: Optional[Callable[[Any], List[Any]]]
    ) -> Optional[Checkpoint]:
        """The newest readable checkpoint in ``source`` (damaged ones reported and skipped), or None;
        ``gather``: the ranks agree on it (see :func:`~framework.checkpoint.resume.load_latest`)."""
        found = load_latest(source, read, gather)
        if found is None:
            return None
        checkpoint, self.loaded_from = found
        return checkpoint

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
        check_name_agrees(url, checkpoint.global_step)
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
        return {"scores": self._scores.state_dict(), "save_dir": self.save_dir, "metric": self.metric, "mode": self.mode}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved_dir = state.get("save_dir")
        if saved_dir is not None and not storage.same_location(saved_dir, self.save_dir):
            return  # scores name files of another directory
        self._scores.load_state_dict(state.get("scores", {}))


def default_checkpointer(
    strategy: Strategy, given: Optional[AbstractCheckpointer], args: DefaultCheckpointerArguments, default_dir: str
) -> AbstractCheckpointer:
    """The checkpointer a trainer uses (``given``, else a :class:`DefaultCheckpointer` from
    ``args``), told which strategy writes and reads its checkpoints."""
    checkpointer = given if given is not None else DefaultCheckpointer(args, default_dir=default_dir)
    checkpointer.setup(strategy)
    return checkpointer
