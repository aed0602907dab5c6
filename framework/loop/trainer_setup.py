"""Setting a trainer up to train: the train loader, the wrapped module, optimizers and schedulers,
the step, callbacks, the run's lock, directory and identity, the resume, and the micro-batch search.

Kept apart from the loop in :mod:`framework.loop.trainer`, which inherits :class:`TrainerSetup`.
"""

import logging
import os
import time
from typing import Any, Callable, List, Optional, cast

import torch

from backends import TrainerBackend
from backends.strategies.activation_checkpointing import checkpoint_units
from framework.callbacks.base import Callback
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.default import DefaultCheckpointer
from framework.data.train_loader import TrainLoader
from framework.loggers import LoggerSet, build_loggers
from framework.loop.hooks import HookDispatcher
from framework.loop.manual_optimization import ManualOptimization
from framework.loop.micro_batch_search import search_micro_batch
from framework.loop.schedulers import LRSchedules, build_optimizers_schedules
from framework.loop.stopping import StopConditions
from framework.loop.training_step import TrainingStep
from framework.loop.view import TrainerView
from framework.metrics.collector import MetricCollector
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface, StepRunner
from framework.run import checks
from framework.run.arguments import TrainerArguments, micro_batch_plan
from framework.run.config import resolved_config
from framework.run.finished_run import changed_settings, log_nothing_to_do
from framework.run.run_directory import choose_run_directory, claim_run_directory, locked_directories
from framework.run.run_identity import StartingIdentity
from framework.run.run_lock import RunLocks, claim_run_lock
from framework.run.run_start import log_run_start
from framework.run.shared_storage import check_shared_storage, run_directories

logger = logging.getLogger("framework")


class TrainerSetup:
    """What :meth:`~framework.Trainer.train` does before its first step (the trainer sets every
    attribute below in its constructor).

    Example:
        trainer._setup_training()   # called by train(); idempotent after the first call
    """

    args: TrainerArguments
    module: ModuleInterface
    backend: TrainerBackend
    checkpointer: AbstractCheckpointer
    loggers: LoggerSet
    callbacks: List[Callback]
    hooks: HookDispatcher
    recorder: MetricRecorder
    stopping: StopConditions
    training_step: TrainingStep
    optimizers: List[torch.optim.Optimizer]
    schedulers: List[Any]
    lr_schedules: LRSchedules
    manual_optimization: Optional[ManualOptimization]
    automatic_optimization: bool
    train_loader: Optional[TrainLoader]
    wrapped_module: Optional[torch.nn.Module]
    train_step_batch_size: int
    gradient_accumulation: int
    run_id: Optional[str]
    _runner: StepRunner
    _forward: Any
    _metrics: MetricCollector
    _restored: bool
    _micro_batch_found: bool
    _run_lock: Optional[RunLocks]
    _identity: StartingIdentity
    _compile_started: Optional[float]

    # Defined by Trainer and TrainerCheckpoints (annotations only: nothing here shadows them).
    checkpointing_enabled: bool
    is_main_process: bool
    global_steps_finished: int
    epochs_finished: int
    _restore_checkpoint: Callable[[], None]
    _watch_run_lock: Callable[[], None]

    # -- setup ----------------------------------------------------------------------------
    @property
    def estimated_global_steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps per epoch: exact when the train loader has a length, else None
        (or ``max_train_steps_per_epoch`` when that is an int). A last, partial accumulation
        cycle counts as a step."""
        return self._create_train_loader().steps_per_epoch

    def _create_train_loader(self) -> TrainLoader:
        if self.train_loader is None:
            self.train_loader = TrainLoader(
                self.module, self.backend, self.args, self.train_step_batch_size, self.gradient_accumulation
            )
        return self.train_loader

    def _setup_training(self) -> None:
        args = self.args
        if not self._restored and not args.fast_dev_run:  # another run's output_dir: train in version_<N>
            self._choose_run_directory()
        if not args.fast_dev_run:  # every rank sees the same directories; a second live run on them stops here
            check_shared_storage(run_directories(args.output_dir, self.checkpointer), self.backend)
            self._run_lock = claim_run_lock(args.output_dir, self.backend, locked_directories(args.output_dir, self.checkpointer))
            self._watch_run_lock()  # a lock taken over by another run stops this one at its next step
        loader = self._create_train_loader()
        if self.wrapped_module is None:
            if args.activation_checkpointing:  # before the strategy compiles and shards the units
                units = checkpoint_units(self.module)
                kinds = sorted({type(unit).__name__ for unit in units})
                logger.info(
                    "activation checkpointing: %d units (%s) recompute their activations in backward",
                    len(units),
                    ", ".join(kinds),
                )
            self.wrapped_module = self.backend.wrap_module(self._runner)
        if not self.optimizers:
            self._build_optimizers()
        self._prepare_step()
        self._prepare_callbacks()
        if not self._restored:
            self._restored = True
            log_run_start(cast(TrainerView, self))  # checkpoint retention; ddp as one process
            if self.checkpointing_enabled:
                loader.position.warn_if_not_resumable()
                loader.seeding.warn_about_worker_randomness(loader.position.resumable_mid_epoch)
            if not args.fast_dev_run:  # before anything is written: never overwrite another run's files
                claim_run_directory(args.output_dir, self.checkpointer, self.backend)
            self._identity = StartingIdentity.read(args.output_dir, self.backend)
            self._restore_checkpoint()  # sets run_id: the resumed run's, or a new one
            if args.gpu_batch_size_limit == "auto" and not self._micro_batch_found:
                found = search_micro_batch(self.module, self.backend, args, self.wrapped_module, self._forward, self._metrics)
                self._use_micro_batch(found, "the largest that fits")
        self.recorder.start_loggers()
        if self.is_main_process and not args.fast_dev_run:
            if self.checkpointer.loaded_from is not None and self.stopping.complete(
                self.epochs_finished, self.global_steps_finished
            ):
                changes = changed_settings(os.path.join(args.output_dir, "config.yaml"), resolved_config(args).to_dict())
                log_nothing_to_do(self.global_steps_finished, self.epochs_finished, changes)  # before config.yaml is rewritten
            resolved_config(args).save(os.path.join(args.output_dir, "config.yaml"), run_id=self.run_id)
        self.stopping.start_clock()
        self._compile_started = time.perf_counter() if args.compile else None
        self.module.train()

    def _choose_run_directory(self) -> None:
        """Move this run to ``<output_dir>/version_<N>`` when ``output_dir`` holds another run (and say so once)."""
        args = self.args
        chosen = choose_run_directory(args.output_dir, args.output_dir_in_use, self.checkpointer, self.backend)
        if chosen == args.output_dir:
            return
        logger.warning(
            "output_dir %s holds another run: this run writes to %s (--checkpointer.resume auto continues the run "
            "there instead; --trainer.output_dir_in_use error refuses)",
            args.output_dir,
            chosen,
        )
        args.output_dir = chosen  # the trainer's own copy of the arguments
        if isinstance(self.checkpointer, DefaultCheckpointer):
            self.checkpointer.use_default_dir(os.path.join(chosen, "checkpoints"))
        self.loggers = self.recorder.loggers = LoggerSet(build_loggers(cast(Any, args)), active=self.loggers.active)

    def _build_optimizers(self) -> None:
        self.optimizers, self.lr_schedules = build_optimizers_schedules(
            self.module,
            self.estimated_global_steps_per_epoch,
            self.args.epochs,
            default_interval=self.args.scheduler_interval,
            default_monitor=self.args.scheduler_monitor,
        )
        self.schedulers = self.lr_schedules.schedulers
        for line in self.lr_schedules.describe(self.automatic_optimization):
            logger.info(line)
        if not self.automatic_optimization:
            self.manual_optimization = ManualOptimization(
                self.backend,
                self.optimizers,
                self.schedulers,
                self.wrapped_module,
                on_backward=lambda loss: self.hooks.call("on_end_backward", self.global_steps_finished, loss),
            )

    def _prepare_step(self) -> None:
        """Hand the step what it runs on; refuse LBFGS where it cannot re-evaluate the loss."""
        assert self.wrapped_module is not None and self.train_loader is not None  # set up by _setup_training
        self._forward = self.backend.step_function(self.wrapped_module, self._runner)
        self.training_step.prepare(
            self._forward,
            self.wrapped_module,
            self.optimizers,
            self.lr_schedules,
            self.automatic_optimization,
            self.train_loader.length,
        )
        if self.training_step.uses_closure and (self.gradient_accumulation > 1 or self.args.tbptt_steps):
            raise ValueError(
                "LBFGS re-evaluates the loss itself: it needs gradient_accumulation == 1 (gpu_batch_size_limit "
                f"unset or >= the per-process batch, got accumulation {self.gradient_accumulation}) and no tbptt_steps"
            )

    def _use_micro_batch(self, size: int, why: str) -> None:
        """``gpu_batch_size_limit="auto"``: train with micro-batches of ``size``, accumulating the
        rest of the batch (the global batch does not change), from a train loader of that size."""
        plan = micro_batch_plan(self.args.train_batch_size, self.backend.data_parallel_size, size)
        if plan != (self.train_step_batch_size, self.gradient_accumulation):
            self.train_step_batch_size, self.gradient_accumulation = plan
            self.train_loader = None
            self._create_train_loader()
            self._prepare_step()
        self._micro_batch_found = True
        logger.info("gpu_batch_size_limit='auto': micro-batch %d, gradient accumulation %d (%s)", *plan, why)

    def _use_saved_micro_batch(self, saved: Any) -> None:
        """Adopt the micro-batch a checkpoint was trained with, unless it does not divide this run's
        per-process batch (another world size): then the search runs again."""
        per_process = self.args.train_batch_size // self.backend.data_parallel_size
        if isinstance(saved, int) and 0 < saved <= per_process and per_process % saved == 0:
            self._use_micro_batch(saved, "from the checkpoint")

    def _micro_batches_this_epoch(self) -> Optional[int]:
        return self._create_train_loader().micro_batches_per_epoch

    def _prepare_callbacks(self) -> None:
        """Hand each callback the trainer; look hooks up afresh (callbacks may have changed)."""
        for callback in self.callbacks:
            callback.setup(cast(TrainerView, self))
        checks.check_hook_signatures(self.module, *self.callbacks)
        self.hooks.refresh()
