"""What the training step runs on: the train loader, the module as the strategy wraps it, the
optimizers and their schedules, and the micro-batch plan (searched with ``gpu_batch_size_limit="auto"``).

A component the :class:`~framework.Trainer` holds as ``trainer.training_setup``; it is given the
few trainer values it needs, nothing else of the trainer. The trainer's ``optimizers``,
``schedulers``, ``train_loader``, ``wrapped_module``, ``train_step_batch_size`` and
``gradient_accumulation`` read from it.
"""

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch

from backends import TrainerBackend
from backends.strategies.activation_checkpointing import checkpoint_units
from framework.config.arguments import TrainerArguments, micro_batch_plan
from framework.data.train_loader import TrainLoader
from framework.loop.hooks import HookDispatcher
from framework.loop.manual_optimization import ManualOptimization
from framework.loop.micro_batch_search import search_micro_batch
from framework.loop.schedulers import LRSchedules, build_optimizers_schedules
from framework.loop.training_state import TrainingProgress
from framework.loop.training_step import TrainingStep
from framework.metrics.collector import MetricCollector
from framework.module import ModuleInterface, StepRunner

logger = logging.getLogger("framework")


class TrainingSetup:
    """Builds, once, what :meth:`~framework.Trainer.train` steps on (``trainer.training_setup``).

    Args:
        module, args, backend, runner: the trainer's own.
        training_step: the step, handed what it runs on (again when the micro-batch changes).
        hooks: ``on_end_backward`` under manual optimization.
        progress: the step count that hook is called with.
        metrics: what ``module.log`` collected (the micro-batch search leaves it as it was).
        plan: ``(micro-batch per process, micro-batches per optimizer step)`` to start with.
        automatic_optimization: False when the module steps its optimizers itself.

    Example:
        setup = trainer.training_setup
        setup.build()                           # loader, wrapped module, optimizers, the step
        setup.train_step_batch_size, setup.gradient_accumulation, setup.optimizers
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        args: TrainerArguments,
        backend: TrainerBackend,
        runner: StepRunner,
        training_step: TrainingStep,
        hooks: HookDispatcher,
        progress: TrainingProgress,
        metrics: MetricCollector,
        plan: Tuple[int, int],
        automatic_optimization: bool,
    ) -> None:
        self.module, self.args, self.backend, self.runner = module, args, backend, runner
        self.training_step, self.hooks, self.progress, self.metrics = training_step, hooks, progress, metrics
        self.train_step_batch_size, self.gradient_accumulation = plan
        self.automatic_optimization = automatic_optimization
        self.train_loader: Optional[TrainLoader] = None
        self.wrapped_module: Optional[torch.nn.Module] = None
        self.optimizers: List[torch.optim.Optimizer] = []
        self.lr_schedules = LRSchedules()  # the schedulers with when each steps (framework/loop/schedulers.py)
        self.manual_optimization: Optional[ManualOptimization] = None
        self.forward: Optional[Callable[..., Any]] = None  # the strategy's step function, once built
        self.micro_batch_found = False  # gpu_batch_size_limit="auto": searched, or read from a checkpoint

    def evaluation_batch_size(self) -> int:
        """The evaluation batch per process now: ``val_batch_size``, else the train micro-batch
        (which the micro-batch search may change)."""
        return self.args.val_batch_size or self.train_step_batch_size

    @property
    def schedulers(self) -> List[Any]:
        """The learning-rate schedulers ``configure_optimizers`` returned, in order."""
        return self.lr_schedules.schedulers

    def loader(self) -> TrainLoader:
        """The train loader for the current micro-batch, built on first use."""
        if self.train_loader is None:
            self.train_loader = TrainLoader(
                self.module, self.backend, self.args, self.train_step_batch_size, self.gradient_accumulation
            )
        return self.train_loader

    def build(self) -> None:
        """The loader, the wrapped module and the optimizers (once), and the step handed all three."""
        self.loader()
        if self.wrapped_module is None:
            if self.args.activation_checkpointing:  # before the strategy compiles and shards the units
                self.backend.build_model(self.runner)  # configure_model() first: the units may be built there
                units = checkpoint_units(self.module)
                kinds = ", ".join(sorted({type(unit).__name__ for unit in units}))
                logger.info("activation checkpointing: %d units (%s) recompute their activations in backward", len(units), kinds)
            self.wrapped_module = self.backend.wrap_module(self.runner)
        if not self.optimizers:
            self._build_optimizers()
        self._prepare_step()

    def _build_optimizers(self) -> None:
        self.optimizers, self.lr_schedules = build_optimizers_schedules(
            self.module,
            self.loader().steps_per_epoch,
            self.args.epochs,
            default_interval=self.args.scheduler_interval,
            default_monitor=self.args.scheduler_monitor,
        )
        for line in self.lr_schedules.describe(self.automatic_optimization):
            logger.info(line)
        if not self.automatic_optimization:
            hooks, progress = self.hooks, self.progress
            self.manual_optimization = ManualOptimization(
                self.backend,
                self.optimizers,
                self.schedulers,
                self.wrapped_module,
                on_backward=lambda loss: hooks.call("on_end_backward", progress.global_steps_finished, loss),
            )

    def _prepare_step(self) -> None:
        """Hand the step what it runs on; refuse LBFGS where it cannot re-evaluate the loss."""
        assert self.wrapped_module is not None  # built by build()
        self.forward = self.backend.step_function(self.wrapped_module, self.runner)
        self.training_step.prepare(
            self.forward,
            self.wrapped_module,
            self.optimizers,
            self.lr_schedules,
            self.automatic_optimization,
            self.loader().length,
        )
        if self.training_step.uses_closure and (self.gradient_accumulation > 1 or self.args.tbptt_steps):
            raise ValueError(
                "LBFGS re-evaluates the loss itself: it needs gradient_accumulation == 1 (gpu_batch_size_limit "
                f"unset or >= the per-process batch, got accumulation {self.gradient_accumulation}) and no tbptt_steps"
            )

    def warn_if_not_resumable(self) -> None:
        """Say at the start when a checkpoint could not resume this loader mid-epoch exactly."""
        loader = self.loader()
        loader.position.warn_if_not_resumable()
        loader.seeding.warn_about_worker_randomness(loader.position.resumable_mid_epoch)

    def search_micro_batch(self) -> None:
        """``gpu_batch_size_limit="auto"``: find the largest micro-batch that fits (once; not when a
        checkpoint gave it)."""
        if self.args.gpu_batch_size_limit == "auto" and not self.micro_batch_found:
            assert self.wrapped_module is not None and self.forward is not None  # built by build()
            found = search_micro_batch(self.module, self.backend, self.args, self.wrapped_module, self.forward, self.metrics)
            self.use_micro_batch(found, "the largest that fits")

    def use_micro_batch(self, size: int, why: str) -> None:
        """Train with micro-batches of ``size``, accumulating the rest of the batch (the global batch
        does not change), from a train loader of that size."""
        plan = micro_batch_plan(self.args.train_batch_size, self.backend.data_parallel_size, size)
        if plan != (self.train_step_batch_size, self.gradient_accumulation):
            self.train_step_batch_size, self.gradient_accumulation = plan
            self.train_loader = None
            self._prepare_step()  # builds the loader of the new size
        self.micro_batch_found = True
        logger.info("gpu_batch_size_limit='auto': micro-batch %d, gradient accumulation %d (%s)", *plan, why)

    def use_saved_micro_batch(self, saved: Any) -> None:
        """Adopt the micro-batch a checkpoint was trained with, unless it does not divide this run's
        per-process batch (another world size): then the search runs again."""
        per_process = self.args.train_batch_size // self.backend.data_parallel_size
        if isinstance(saved, int) and 0 < saved <= per_process and per_process % saved == 0:
            self.use_micro_batch(saved, "from the checkpoint")
