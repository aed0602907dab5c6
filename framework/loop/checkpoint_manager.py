"""The trainer's checkpoints: building its state, saving it on the right ranks, restoring it at setup.

A component the :class:`~framework.Trainer` holds as ``trainer.checkpoint_manager``; it is given the
few trainer values it needs, nothing else of the trainer. ``trainer.save_checkpoint``,
``save_model_checkpoint``, ``state_dict`` and ``load_state_dict`` call it.
"""

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from backends import TrainerBackend, map_tensors
from backends.checkpoint_io import optimizer_names
from framework.callbacks.base import Callback, callback_states, saved_states
from framework.checkpoint import AbstractCheckpointer, Checkpoint
from framework.config.arguments import TrainerArguments
from framework.data.rng import capture_rng_state
from framework.loop import module_checks as checks
from framework.loop.optimizer_changes import (
    OPTIMIZER_TYPES_KEY,
    ConfiguredHyperparameters,
    check_optimizer_classes,
    optimizer_types,
)
from framework.loop.stopping import StopConditions
from framework.loop.training_setup import TrainingSetup
from framework.loop.training_state import PendingRng, TrainingProgress
from framework.metrics.collector import MetricCollector, MetricHistory
from framework.metrics.loss_tracker import LossTracker
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface
from framework.run.run_claim import RunClaim
from framework.run.run_identity import OUTPUT_DIR_KEY, RUN_ID_KEY, StartingIdentity

logger = logging.getLogger("framework")


class CheckpointManager:
    """Saves and restores the whole run, for :class:`~framework.Trainer` (``trainer.checkpoint_manager``).

    Args:
        module, args, backend, checkpointer: the trainer's own.
        setup: the loader (its position), optimizers, schedulers and micro-batch plan.
        progress: the counters and the position in the epoch.
        stopping: ``should_stop`` is saved and restored.
        losses, metrics: running losses and logged values, saved per rank.
        history, recorder: the metric history and the loggers (a tracker's run id).
        callbacks: each callback's ``state_dict()``.
        run_claim: no write once the run's lock was taken over.

    Example:
        trainer.checkpoint_manager.save()        # what trainer.save_checkpoint() calls, on every rank
        trainer.checkpoint_manager.run_id        # this run's id, once training has set up
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        args: TrainerArguments,
        backend: TrainerBackend,
        checkpointer: AbstractCheckpointer,
        setup: TrainingSetup,
        progress: TrainingProgress,
        stopping: StopConditions,
        losses: LossTracker,
        metrics: MetricCollector,
        history: MetricHistory,
        recorder: MetricRecorder,
        callbacks: List[Callback],
        run_claim: RunClaim,
    ) -> None:
        self.module, self.args, self.backend, self.checkpointer = module, args, backend, checkpointer
        self.setup, self.progress, self.stopping, self.losses, self.metrics = setup, progress, stopping, losses, metrics
        self.history, self.recorder, self.callbacks = history, recorder, callbacks
        self.run_claim = run_claim
        self.pending_rng = PendingRng()
        """Restored RNG states, waiting for the train loader's iterator (see ``Trainer._start_epoch``)."""
        self.run_id: Optional[str] = None
        """This run's id (in config.yaml and every checkpoint), known once training has set up."""

    def save(self, epoch: Optional[int] = None, force: bool = True) -> Optional[str]:
        """Save module, trainer and backend state now (or, with ``force=False``, if a save is due);
        where it went, or None (see :meth:`framework.Trainer.save_checkpoint`)."""
        self.run_claim.check()  # a run whose lock was taken over writes nothing more
        progress, loader = self.progress, self.setup.train_loader
        if progress.batches_finished_in_epoch and loader is not None and not loader.position.resumable_mid_epoch:
            loader.position.skip_save(progress.global_steps_finished)  # a checkpoint no later run could resume
            return None
        checkpoint = self.current()
        return self.checkpointer.save(checkpoint, progress.epochs_finished if epoch is None else epoch, force=force)

    def save_and_wait(self) -> None:
        """Save now (unless checkpointing is off: ``fast_dev_run``) and wait until it is written."""
        if not self.args.fast_dev_run:
            self.save()
        self.checkpointer.wait()

    def current(self) -> Checkpoint:
        """The run's state now (collective under DDP: call on every rank)."""
        trainer_state = self.state_dict()  # collective under DDP: every rank builds it
        step = self.progress.global_steps_finished
        return Checkpoint(
            module_state=self.module.get_state(),
            trainer_state=trainer_state,
            backend_state=self.backend.state_dict(),
            global_step=step,
            epoch=self.progress.epochs_finished,
            # Only values measured on these weights rank the checkpoint (best-k retention).
            metrics={record["name"]: record["value"] for record in self.history.records if record["step"] == step},
        )

    def save_model(self) -> Optional[str]:
        """Write the module's full weights alone (for inference), on rank zero (call on every rank)."""
        self.run_claim.check()
        state = self.backend.unsharded(self.module.get_state())  # fsdp: gathered from the shards
        step = self.progress.global_steps_finished
        location = self.backend.run_on_rank_zero(lambda: self.checkpointer.save_model(state, step), "failed to export the model")
        return location if self.backend.is_main_process else None

    def restore(self) -> None:
        """At setup: load the checkpoint the checkpointer finds (if any) and set :attr:`run_id`."""
        identity = StartingIdentity.read(self.args.output_dir, self.backend)
        checkpoint = self.checkpointer.load_into(self.current, self.setup.optimizers)  # sharded: in place
        steps = self.backend.all_gather_object(None if checkpoint is None else checkpoint.global_step)
        if len(set(steps)) > 1:
            raise RuntimeError(
                f"the ranks loaded different checkpoints (global step per rank: {steps}); every rank must "
                f"see the same checkpoint directory: use a shared filesystem or URL for save_dir/load_dir"
            )
        path = self.checkpointer.loaded_from
        saved = {} if checkpoint is None else checkpoint.trainer_state
        self.run_id = identity.after_load(
            saved.get(RUN_ID_KEY), self.checkpointer.resumed_automatically(), path, saved.get(OUTPUT_DIR_KEY)
        )
        if checkpoint is None:
            return
        with checks.naming_missing_keys(path, "module state"):
            self.module.update_state({**checkpoint.module_state, **self._own_module_state(checkpoint.trainer_state)})
        if self.checkpointer.restores_model_only():  # reset_optimizers_schedulers: weights only
            return
        optimizers, schedulers = self.setup.optimizers, self.setup.schedulers
        one_stage = bool(getattr(self.backend.strategy, "pipelined", False))
        checks.check_optimizer_state_compatible(checkpoint.trainer_state, optimizers, schedulers, path, one_stage)
        check_optimizer_classes(checkpoint.trainer_state, optimizers, path)
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
        """The trainer's state (see :meth:`framework.Trainer.state_dict`; collective under DDP)."""
        setup, loader = self.setup, self.setup.train_loader
        rank_local = {  # differs between ranks: gathered, each rank restores its own (by data-parallel rank)
            "data_parallel_rank": self.backend.data_parallel_rank,
            "rng": capture_rng_state(),
            **self.losses.state_dict(),
            "logged_values": self.metrics.state_dict(),
            "loader": None if loader is None else loader.position.state_dict(),
            "module": map_tensors({key: value for key, value in self.module.get_state().items() if key != "model"}, _to_cpu),
        }
        return {
            RUN_ID_KEY: self.run_id,
            OUTPUT_DIR_KEY: os.path.abspath(self.args.output_dir),
            **self.progress.state_dict(self.backend.data_parallel_size, setup.train_step_batch_size),
            "should_stop": self.stopping.should_stop,
            "ranks": self.backend.all_gather_object(rank_local),
            "optimizers": [self._optimizer_state(optimizer) for optimizer in setup.optimizers],
            OPTIMIZER_TYPES_KEY: optimizer_types(setup.optimizers),
            "schedulers": [scheduler.state_dict() for scheduler in setup.schedulers],
            "callbacks": callback_states(self.callbacks),
            "checkpointer": self.checkpointer.state_dict(),
            "history": self.history.state_dict(),
            "loggers": self.recorder.loggers.state_dict(),  # e.g. a tracker's run id, so a resumed run logs into it
        }

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """``optimizer``'s state, keyed by parameter name where parameters are sharded (a sharded
        checkpoint: see :mod:`backends.checkpoint_io.optimizer_names`), else by position."""
        if self.backend.shards_parameters:
            return optimizer_names.by_name(optimizer, self.module)
        return optimizer.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (optimizers must exist: call inside train)."""
        setup = self.setup
        world_size = self.backend.data_parallel_size  # positions are counted in shares of the data
        if self.args.gpu_batch_size_limit == "auto":  # the micro-batch found before: no search on resume
            setup.use_saved_micro_batch(state.get("micro_batch_size"))
        self.progress.load_state_dict(state, world_size, setup.train_step_batch_size, setup.gradient_accumulation)
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
        self.metrics.load_state_dict(mine["logged_values"], self.backend.device)
        if setup.train_loader is not None:
            setup.train_loader.position.load_state_dict(mine.get("loader"))
        self.pending_rng.set(mine["rng"])  # restored around the train loader's iterator (see Trainer._start_epoch)
        self.stopping.should_stop = bool(state["should_stop"])
        configured = ConfiguredHyperparameters(setup.optimizers)
        one_stage = bool(getattr(self.backend.strategy, "pipelined", False))  # a pipeline's stage: its own names only
        for optimizer, optimizer_state in zip(setup.optimizers, state["optimizers"]):
            optimizer_names.load_into(optimizer, optimizer_state, self.module, one_stage)  # by name, or by position (older)
        for scheduler, scheduler_state in zip(setup.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        for callback, saved in saved_states(self.callbacks, state["callbacks"]):
            if saved is not None:
                callback.load_state_dict(saved)
        driven = {key for callback in self.callbacks for key in getattr(callback, "drives_hyperparameters", tuple)()}
        configured.restore(setup.optimizers, driven)  # a changed hyperparameter: warned, the configured value used
        self.checkpointer.load_state_dict(state.get("checkpointer", {}))
        self.history.load_state_dict(state["history"])
        self.recorder.loggers.load_state_dict(state.get("loggers", {}))


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()
