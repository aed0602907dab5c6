"""The trainer's checkpoints: building its state, saving it on the right ranks, restoring it.

Kept apart from the loop in :mod:`framework.loop.trainer`, which inherits :class:`TrainerCheckpoints`.
"""

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from backends import TrainerBackend, map_tensors
from framework.callbacks.base import Callback, callback_states, saved_states
from framework.checkpoint import AbstractCheckpointer, Checkpoint
from framework.data.rng import capture_rng_state
from framework.data.train_loader import TrainLoader
from framework.loggers import LoggerSet
from framework.loop.optimizer_changes import (
    OPTIMIZER_TYPES_KEY,
    ConfiguredHyperparameters,
    check_optimizer_classes,
    optimizer_types,
)
from framework.loop.training_state import PendingRng, TrainingProgress
from framework.metrics.collector import MetricCollector, MetricHistory
from framework.metrics.loss_tracker import LossTracker
from framework.module import ModuleInterface
from framework.run import checks
from framework.run.arguments import TrainerArguments
from framework.run.preemption import PreemptionHandler
from framework.run.run_identity import OUTPUT_DIR_KEY, RUN_ID_KEY, StartingIdentity
from framework.run.run_lock import RunLockLost, RunLocks

logger = logging.getLogger("framework")


class TrainerCheckpoints:
    """``save_checkpoint``, ``save_model_checkpoint``, ``state_dict``/``load_state_dict`` and the
    restore at setup, for :class:`~framework.Trainer` (which sets every attribute below).

    Example:
        trainer.save_checkpoint()          # on every rank, at a step boundary
        state = trainer.state_dict()       # collective under DDP
    """

    args: TrainerArguments
    module: ModuleInterface
    backend: TrainerBackend
    checkpointer: AbstractCheckpointer
    callbacks: List[Callback]
    history: MetricHistory
    loggers: LoggerSet
    progress: TrainingProgress
    losses: LossTracker
    optimizers: List[torch.optim.Optimizer]
    schedulers: List[Any]
    train_step_batch_size: int
    gradient_accumulation: int
    _metrics: MetricCollector
    _pending_rng: PendingRng
    train_loader: Optional[TrainLoader]
    run_id: Optional[str]
    _identity: StartingIdentity
    _run_lock: Optional[RunLocks]
    preemption: PreemptionHandler

    def _use_saved_micro_batch(self, saved: Any) -> None:  # defined by Trainer
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the module and batches live."""
        return self.backend.device

    @property
    def is_main_process(self) -> bool:
        """True on rank zero: the rank that prints and writes files."""
        return self.backend.is_main_process

    @property
    def global_steps_finished(self) -> int:
        """Optimizer steps finished (manual optimization: training batches finished)."""
        return self.progress.global_steps_finished

    @property
    def epochs_finished(self) -> int:
        """Epochs finished."""
        return self.progress.epochs_finished

    @property
    def checkpointing_enabled(self) -> bool:
        """False under ``fast_dev_run``."""
        return not self.args.fast_dev_run

    def _watch_run_lock(self) -> None:
        """Stop at the next step boundary when another run takes this run's lock (rank zero's heartbeat
        finds it; the ranks agree on the stop as on a signal), then :meth:`_check_run_lock` ends the run."""
        if self._run_lock is not None:
            self._run_lock.on_lost(lambda: self.preemption.request("the loss of the run lock"))

    def _check_run_lock(self) -> None:
        """Raise :class:`RunLockLost` on every rank when rank zero's lock was taken over (before any write;
        collective: call on every rank)."""
        problem = None
        if self._run_lock is not None:
            try:
                self._run_lock.check()
            except RunLockLost as error:
                problem = str(error)
        if self.backend.world_size > 1:
            problem = self.backend.broadcast_object(problem)
        if problem is not None:
            raise RunLockLost(problem)

    def save_checkpoint(self, epoch: Optional[int] = None, force: bool = True) -> Optional[str]:
        """Save module, trainer and backend state now (or, with ``force=False``, if a save is due).

        Call it on every rank, at an optimizer-step boundary (e.g. from ``on_end_optimizer_step``)
        for an exact resume. Every rank builds the state (RNG states are gathered) and hands it
        to the checkpointer, which writes through the strategy (one file from rank zero, or
        shards from every rank); every rank raises if the save failed on any rank.
        Returns where the checkpoint went, or None when it was not due.

        Args:
            epoch: epochs finished, that the checkpointer's epoch schedule is asked about
                (default: now).
            force: save whether or not the schedule says a save is due.
        """
        self._check_run_lock()  # a run whose lock was taken over writes nothing more
        step = self.global_steps_finished
        position = None if self.train_loader is None else self.train_loader.position
        if self.progress.batches_finished_in_epoch and position is not None and not position.resumable_mid_epoch:
            position.skip_save(step)  # a checkpoint no later run could resume
            return None
        checkpoint = self._current_checkpoint()
        return self.checkpointer.save(checkpoint, self.epochs_finished if epoch is None else epoch, force=force)

    def _current_checkpoint(self) -> Checkpoint:
        """The run's state now (collective under DDP: call on every rank)."""
        trainer_state = self.state_dict()  # collective under DDP: every rank builds it
        step = self.global_steps_finished
        return Checkpoint(
            module_state=self.module.get_state(),
            trainer_state=trainer_state,
            backend_state=self.backend.state_dict(),
            global_step=step,
            epoch=self.epochs_finished,
            # Only values measured on these weights rank the checkpoint (best-k retention).
            metrics={record["name"]: record["value"] for record in self.history.records if record["step"] == step},
        )

    def save_model_checkpoint(self) -> Optional[str]:
        """Write the module's full weights alone (for inference), on rank zero (call on every rank)."""
        self._check_run_lock()
        state = self.backend.unsharded(self.module.get_state())  # fsdp: gathered from the shards
        step = self.global_steps_finished
        location = self.backend.run_on_rank_zero(lambda: self.checkpointer.save_model(state, step), "failed to export the model")
        return location if self.is_main_process else None

    def _restore_checkpoint(self) -> None:
        checkpoint = self.checkpointer.load_into(self._current_checkpoint, self.optimizers)  # sharded: in place
        steps = self.backend.all_gather_object(None if checkpoint is None else checkpoint.global_step)
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"the ranks loaded different checkpoints (global step per rank: {steps}); every rank must "
                f"see the same checkpoint directory: use a shared filesystem or URL for save_dir/load_dir"
            )
        path = self.checkpointer.loaded_from
        saved = {} if checkpoint is None else checkpoint.trainer_state
        self.run_id = self._identity.after_load(
            saved.get(RUN_ID_KEY), self.checkpointer.resumed_automatically(), path, saved.get(OUTPUT_DIR_KEY)
        )
        if checkpoint is None:
            return
        with checks.naming_missing_keys(path, "module state"):
            self.module.update_state({**checkpoint.module_state, **self._own_module_state(checkpoint.trainer_state)})
        if self.checkpointer.restores_model_only():  # reset_optimizers_schedulers: weights only
            return
        checks.check_optimizer_state_compatible(checkpoint.trainer_state, self.optimizers, self.schedulers, path)
        check_optimizer_classes(checkpoint.trainer_state, self.optimizers, path)
        with checks.naming_missing_keys(path, "trainer state"):
            self.backend.load_state_dict(checkpoint.backend_state)
            self.load_state_dict(checkpoint.trainer_state)

    def _own_module_state(self, trainer_state: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's entries of the module's ``get_state()`` besides its weights (``"model"``),
        as saved by rank (``rank % saved world size`` on another world size); empty for
        checkpoints written before they were saved per rank."""
        ranks = trainer_state.get("ranks") if isinstance(trainer_state, dict) else None
        if not ranks:
            return {}
        return dict(self._own_entry(ranks).get("module", {}))

    def _own_entry(self, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The saved per-rank entry this rank restores: the one of its data-parallel rank (modulo the
        saved data-parallel size: any tensor-parallel peer's, they are alike); by global rank (modulo
        the saved world size) for checkpoints written before entries named their data-parallel rank."""
        if "data_parallel_rank" not in ranks[0]:
            return ranks[self.backend.rank % len(ranks)]
        saved = {int(entry["data_parallel_rank"]): entry for entry in reversed(ranks)}  # the first of each share wins
        return saved[self.backend.data_parallel_rank % len(saved)]

    def state_dict(self) -> Dict[str, Any]:
        """Counters and the position in the epoch (the sampler is fast-forwarded to it), optimizers,
        schedulers, callbacks, history, and per rank: RNG states, running losses, logged values,
        the loader's or dataset's ``state_dict()``, and the module's ``get_state()`` entries other
        than ``"model"`` (the user's own state, e.g. a replay buffer: each rank restores its own).
        Collective under DDP (the per-rank part is gathered): call it on every rank."""
        rank_local = {  # differs between ranks: gathered, each rank restores its own (by data-parallel rank)
            "data_parallel_rank": self.backend.data_parallel_rank,
            "rng": capture_rng_state(),
            **self.losses.state_dict(),
            "logged_values": self._metrics.state_dict(),
            "loader": None if self.train_loader is None else self.train_loader.position.state_dict(),
            "module": map_tensors({key: value for key, value in self.module.get_state().items() if key != "model"}, _to_cpu),
        }
        return {
            RUN_ID_KEY: self.run_id,
            OUTPUT_DIR_KEY: os.path.abspath(self.args.output_dir),
            **self.progress.state_dict(self.backend.data_parallel_size, self.train_step_batch_size),
            "should_stop": self.should_stop,
            "ranks": self.backend.all_gather_object(rank_local),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            OPTIMIZER_TYPES_KEY: optimizer_types(self.optimizers),
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            "callbacks": callback_states(self.callbacks),
            "checkpointer": self.checkpointer.state_dict(),
            "history": self.history.state_dict(),
            "loggers": self.loggers.state_dict(),  # e.g. a tracker's run id, so a resumed run logs into it
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (optimizers must exist: call inside train)."""
        world_size = self.backend.data_parallel_size  # positions are counted in shares of the data
        if self.args.gpu_batch_size_limit == "auto":  # the micro-batch found before: no search on resume
            self._use_saved_micro_batch(state.get("micro_batch_size"))
        self.progress.load_state_dict(state, world_size, self.train_step_batch_size, self.gradient_accumulation)
        ranks = state["ranks"]
        saved_size = len({entry.get("data_parallel_rank", index) for index, entry in enumerate(ranks)})
        if saved_size != world_size:
            logger.warning(
                "checkpoint written by %d data-parallel ranks, resumed on %d: RNG streams, running losses, loader state "
                "and the module's per-rank state are taken from data-parallel rank (this one mod %d)",
                saved_size,
                world_size,
                saved_size,
            )
        mine = self._own_entry(ranks)
        self.losses.load_state_dict(mine)
        self._metrics.load_state_dict(mine["logged_values"], self.device)
        if self.train_loader is not None:
            self.train_loader.position.load_state_dict(mine.get("loader"))
        self._pending_rng.set(mine["rng"])  # restored around the train loader's iterator (see _start_epoch)
        self.should_stop = bool(state["should_stop"])
        configured = ConfiguredHyperparameters(self.optimizers)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        for callback, saved in saved_states(self.callbacks, state["callbacks"]):
            if saved is not None:
                callback.load_state_dict(saved)
        driven = {key for callback in self.callbacks for key in getattr(callback, "drives_hyperparameters", tuple)()}
        configured.restore(self.optimizers, driven)  # a changed hyperparameter: warned, the configured value used
        self.checkpointer.load_state_dict(state.get("checkpointer", {}))
        self.history.load_state_dict(state["history"])
        self.loggers.load_state_dict(state.get("loggers", {}))


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()
