"""The parts a :class:`~framework.Trainer` is made of, and who is given what: the trainer's wiring
diagram, read top to bottom. Each part takes what it needs by keyword; none is given the trainer
(the callbacks are handed it through ``prepare_callbacks``, built here). If building fails, the
backend (set up first: ranks are known before anything reads them) is torn down.
"""

import dataclasses
import os
from typing import List, Optional, Sequence

from backends import TrainerBackend, build_backend
from framework.callbacks.base import Callback
from framework.callbacks.defaults import with_default_callbacks
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.default import default_checkpointer
from framework.config.arguments import TrainerArguments, micro_batch_plan
from framework.config.cli import config_callbacks
from framework.evaluation.loops import Evaluator
from framework.evaluation.trainer_evaluation import TrainerEvaluation
from framework.lifecycle.launcher_watch import LauncherWatch
from framework.lifecycle.logging_setup import configure_logging
from framework.lifecycle.preemption import PreemptionHandler, parse_signals
from framework.loggers import LoggerSet, build_loggers
from framework.loop import module_checks
from framework.loop.checkpoint_manager import CheckpointManager
from framework.loop.hooks import HookDispatcher
from framework.loop.run_start import RunStart
from framework.loop.schedule_errors import explain_exhausted_schedule
from framework.loop.stopping import StopConditions
from framework.loop.training_setup import TrainingSetup
from framework.loop.training_state import TrainingProgress
from framework.loop.training_step import TrainingStep
from framework.loop.view import TrainerView
from framework.metrics.collector import MetricCollector, MetricHistory
from framework.metrics.loss_tracker import LossTracker
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface, StepRunner
from framework.run.run_claim import RunClaim


@dataclasses.dataclass(frozen=True)
class TrainerParts:
    """What :func:`build_parts` builds; the trainer holds each field under the same name.

    Example:
        parts = build_parts(module=module, args=args, backend=None, checkpointer=None, callbacks=[], view=trainer)
        parts.run_start.run()     # what Trainer.train() calls first
    """

    preemption: PreemptionHandler  # signals that stop training at a step boundary
    backend: TrainerBackend  # set up: ranks and the device are known
    launcher_watch: LauncherWatch  # the launcher's death stops training at a step boundary
    checkpointer: AbstractCheckpointer  # writes and reads through the strategy
    callbacks: List[Callback]  # the user's, the config's, then the defaults (ModelSummary, ProgressBar)
    hooks: HookDispatcher
    history: MetricHistory
    progress: TrainingProgress
    losses: LossTracker
    collector: MetricCollector  # what module.log collects, on the device
    stopping: StopConditions
    recorder: MetricRecorder  # owns the loggers
    runner: StepRunner
    training_step: TrainingStep  # one optimizer step: micro-batches, clipping, the step
    training_setup: TrainingSetup  # loader, wrapped module, optimizers, schedules, micro-batch plan
    run_claim: RunClaim  # version_<N>, the run's lock
    checkpoint_manager: CheckpointManager  # save, restore, state_dict
    run_start: RunStart  # what train() does before its first step
    evaluator: Evaluator
    evaluation: TrainerEvaluation  # validate, test, predict: outside training


def build_parts(
    *,
    module: ModuleInterface,
    args: TrainerArguments,
    backend: Optional[TrainerBackend],
    checkpointer: Optional[AbstractCheckpointer],
    callbacks: Sequence[Callback],
    view: TrainerView,
) -> TrainerParts:
    """Build the trainer's parts for ``module``: ``backend`` and ``checkpointer`` as ``Trainer`` takes
    them (None: from ``args``); ``view`` is the trainer as callbacks and error messages see it (only
    the closures below hold it, no part does)."""
    preemption = PreemptionHandler(parse_signals(args.preemption_signals))
    if backend is not None:
        backend.check_options(args)  # an instance keeps its own options: refuse arguments it would lose
    backend = backend if backend is not None else build_backend(args.backend, args)
    backend.setup()  # every option went to the strategy's and the precision's constructors
    try:
        return _build(module, args, backend, checkpointer, callbacks, preemption, view)
    except Exception:
        backend.teardown()
        raise


def _build(
    module: ModuleInterface,
    args: TrainerArguments,
    backend: TrainerBackend,
    given_checkpointer: Optional[AbstractCheckpointer],
    given_callbacks: Sequence[Callback],
    preemption: PreemptionHandler,
    view: TrainerView,
) -> TrainerParts:
    environment = backend.cluster_environment
    launcher_watch = LauncherWatch(handler=preemption, launcher=environment.launcher, enabled=environment.parent_is_launcher)
    configure_logging(args.log_level, backend.is_main_process)
    checkpointer = default_checkpointer(
        backend.strategy, given_checkpointer, args.checkpointer_args, default_dir=os.path.join(args.output_dir, "checkpoints")
    )
    callbacks = with_default_callbacks([*given_callbacks, *config_callbacks(args)], args)
    plan = micro_batch_plan(args.train_batch_size, backend.data_parallel_size, args.gpu_batch_size_limit)
    automatic = module_checks.check_optimization_mode(module, args, plan[1])
    loggers = LoggerSet(build_loggers(args), active=backend.is_main_process and not args.fast_dev_run)
    hooks = HookDispatcher(module, callbacks)
    history, progress, collector = MetricHistory(), TrainingProgress(), MetricCollector()
    losses = LossTracker(backend.device)
    stopping = StopConditions(args=args, backend=backend, preemption=preemption)
    recorder = MetricRecorder(
        args=args,
        backend=backend,
        progress=progress,
        history=history,
        loggers=loggers,
        hooks=hooks,
        collector=collector,
        losses=losses,
    )
    recorder.hidden_names = module.logger_off_names  # self.log(..., logger=False): history and hooks only
    training_step = TrainingStep(
        module=module, args=args, backend=backend, hooks=hooks, progress=progress, losses=losses, collector=collector
    )
    training_step.explain_schedule_error = lambda error: explain_exhausted_schedule(error, view)
    runner = StepRunner(module)
    training_setup = TrainingSetup(
        module=module,
        args=args,
        backend=backend,
        runner=runner,
        training_step=training_step,
        hooks=hooks,
        progress=progress,
        metrics=collector,
        plan=plan,
        automatic_optimization=automatic,
    )
    run_claim = RunClaim(
        args=args, checkpointer=checkpointer, backend=backend, on_lost=lambda: preemption.request("the loss of the run lock")
    )
    checkpoint_manager = CheckpointManager(
        module=module,
        args=args,
        backend=backend,
        checkpointer=checkpointer,
        setup=training_setup,
        progress=progress,
        stopping=stopping,
        losses=losses,
        metrics=collector,
        history=history,
        recorder=recorder,
        callbacks=callbacks,
        run_claim=run_claim,
    )

    def prepare_callbacks() -> None:
        """Hand each callback the trainer; look hooks up afresh (callbacks may have changed)."""
        for callback in callbacks:
            callback.setup(view)
        module_checks.check_hook_signatures(module, *callbacks)
        hooks.refresh()

    run_start = RunStart(
        module=module,
        args=args,
        backend=backend,
        checkpointer=checkpointer,
        progress=progress,
        prepare_callbacks=prepare_callbacks,
        setup=training_setup,
        checkpoint_manager=checkpoint_manager,
        run_claim=run_claim,
        recorder=recorder,
        stopping=stopping,
    )
    evaluator = Evaluator(module=module, runner=runner, backend=backend, hooks=hooks, args=args, record=recorder.record)
    evaluation = TrainerEvaluation(
        module=module,
        backend=backend,
        checkpointer=checkpointer,
        args=args,
        evaluator=evaluator,
        runner=runner,
        progress=progress,
        recorder=recorder,
        callbacks=callbacks,
        prepare_callbacks=prepare_callbacks,
        batch_size=training_setup.evaluation_batch_size,
        resumed=lambda: run_start.started,
        before_first_write=run_claim.note_evaluation,
    )
    return TrainerParts(
        preemption=preemption,
        backend=backend,
        launcher_watch=launcher_watch,
        checkpointer=checkpointer,
        callbacks=callbacks,
        hooks=hooks,
        history=history,
        progress=progress,
        losses=losses,
        collector=collector,
        stopping=stopping,
        recorder=recorder,
        runner=runner,
        training_step=training_step,
        training_setup=training_setup,
        run_claim=run_claim,
        checkpoint_manager=checkpoint_manager,
        run_start=run_start,
        evaluator=evaluator,
        evaluation=evaluation,
    )


__all__ = ["TrainerParts", "build_parts"]
