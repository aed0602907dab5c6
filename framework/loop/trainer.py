"""Trainer: the training loop, in one place."""

import dataclasses
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from backends import TrainerBackend, build_backend
from backends.strategies.meta_init import move_module
from framework import export
from framework.callbacks.base import Callback, StopTraining
from framework.callbacks.defaults import with_default_callbacks
from framework.checkpoint import AbstractCheckpointer
from framework.checkpoint.default import default_checkpointer
from framework.data.rng import seed_everything
from framework.data.train_loader import TrainLoader
from framework.evaluation.loops import Evaluator
from framework.evaluation.sanity_check import run_sanity_check, sanity_check_due
from framework.evaluation.trainer_evaluation import TrainerEvaluation
from framework.loggers import LoggerSet, build_loggers, run_status
from framework.loop.hooks import HookDispatcher
from framework.loop.manual_optimization import ManualOptimization
from framework.loop.schedule_errors import explain_exhausted_schedule
from framework.loop.schedulers import LRSchedules
from framework.loop.stage import Stage
from framework.loop.step_outputs import concatenate_outputs
from framework.loop.stopping import StopConditions
from framework.loop.trainer_checkpoints import TrainerCheckpoints
from framework.loop.trainer_setup import TrainerSetup
from framework.loop.training_state import PendingRng, TrainingProgress, accumulation_cycles
from framework.loop.training_step import TrainingStep
from framework.metrics.collector import MetricCollector, MetricHistory
from framework.metrics.loss_tracker import LossTracker
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface, StepRunner
from framework.run import checks
from framework.run.arguments import TrainerArguments, micro_batch_plan
from framework.run.config import config_callbacks, own_copy
from framework.run.launcher_watch import LauncherWatch
from framework.run.logging_setup import configure_logging
from framework.run.preemption import PreemptionHandler, TrainingPreempted, parse_signals
from framework.run.run_lock import RunLocks

logger = logging.getLogger("framework")


class Trainer(TrainerSetup, TrainerCheckpoints):
    """Runs epochs of a :class:`ModuleInterface` on a :class:`TrainerBackend`.

    The loop in :meth:`_train_epoch` reads like a hand-written PyTorch loop: for each
    optimizer step, its micro-batches (forward and backward, all but the last under
    ``no_sync``), then unscale, clip, step and zero (:class:`TrainingStep`); then log if due,
    validate if due, save if due. Losses stay on the device and are read back only every
    ``log_every_n_steps``. With ``automatic_optimization = False`` the module's ``train_step``
    does its own backward passes and steps (see ``docs/manual-optimization.md``).

    Args:
        module: the user's module.
        args: run arguments (default: ``TrainerArguments()``).
        trainer_backend: a backend instance; None builds ``args.backend`` by name.
        checkpointer: None uses a :class:`DefaultCheckpointer` from ``args.checkpointer_args``.
        callbacks: called after the module's own hooks, in this order. A model summary and a
            progress bar are put first unless ``args.model_summary=False``/``args.disable_tqdm``
            or one of the kind is given.

    Example:
        trainer = Trainer(module=MyModule(), args=TrainerArguments(epochs=3))
        trainer.train()
        trainer.history.latest("val_loss")
    """

    def __init__(
        self,
        module: ModuleInterface,
        args: Optional[TrainerArguments] = None,
        trainer_backend: Optional[TrainerBackend] = None,
        checkpointer: Optional[AbstractCheckpointer] = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        if not isinstance(module, ModuleInterface):
            raise TypeError(f"module must be a ModuleInterface, got {type(module).__name__}")
        args = args if args is not None else TrainerArguments()
        if not isinstance(args, TrainerArguments):
            raise TypeError(f"args must be TrainerArguments, got {type(args).__name__}")
        if args.fast_dev_run:
            args = dataclasses.replace(args, epochs=1, min_epochs=0, max_train_steps_per_epoch=1, max_val_steps_per_epoch=1)
        else:
            args = own_copy(args)  # output_dir may move to version_<N>
        if trainer_backend is not None and not isinstance(trainer_backend, TrainerBackend):
            raise TypeError(f"trainer_backend must be a TrainerBackend, got {type(trainer_backend).__name__}")
        self.args = args
        self.module = module
        self.preemption = PreemptionHandler(parse_signals(args.preemption_signals))
        if trainer_backend is not None:
            trainer_backend.check_options(args)  # an instance keeps its own options: refuse arguments it would lose
        self.backend = trainer_backend if trainer_backend is not None else build_backend(args.backend, args)
        self.backend.setup()  # every option went to the strategy's and the precision's constructors
        environment = self.backend.cluster_environment
        self.launcher_watch = LauncherWatch(self.preemption, environment.launcher, environment.parent_is_launcher)
        try:
            configure_logging(args.log_level, self.backend.is_main_process)
            self.train_step_batch_size, self.gradient_accumulation = micro_batch_plan(
                args.train_batch_size, self.backend.data_parallel_size, args.gpu_batch_size_limit
            )
            self.automatic_optimization = checks.check_optimization_mode(module, args, self.gradient_accumulation)
            self.loggers = LoggerSet(build_loggers(args), active=self.backend.is_main_process and not args.fast_dev_run)
        except Exception:
            self.backend.teardown()
            raise
        self.checkpointer = default_checkpointer(  # writes and reads through the strategy
            self.backend.strategy, checkpointer, args.checkpointer_args, default_dir=os.path.join(args.output_dir, "checkpoints")
        )
        callbacks = [*callbacks, *config_callbacks(args)]  # + the config's trainer.callbacks
        self.callbacks: List[Callback] = with_default_callbacks(callbacks, args)  # + ModelSummary, ProgressBar
        self.hooks = HookDispatcher(module, self.callbacks)
        self.history = MetricHistory()
        self.progress = TrainingProgress()
        self.losses = LossTracker(self.device)
        self._metrics = MetricCollector()  # what module.log collects, on the device
        self.stopping = StopConditions(args, self.backend, self.preemption)
        self.recorder = MetricRecorder(
            args, self.backend, self.progress, self.history, self.loggers, self.hooks, self._metrics, self.losses
        )
        self.recorder.hidden_names = module.logger_off_names  # self.log(..., logger=False): history and hooks only
        self.training_step = TrainingStep(module, args, self.backend, self.hooks, self.progress, self.losses, self._metrics)
        self.training_step.explain_schedule_error = lambda error: explain_exhausted_schedule(error, self)
        self.optimizers: List[torch.optim.Optimizer] = []
        self.schedulers: List[Any] = []
        self.lr_schedules = LRSchedules()  # the schedulers with when each steps (framework/loop/schedulers.py)
        self.manual_optimization: Optional[ManualOptimization] = None
        self.train_loader: Optional[TrainLoader] = None
        self.wrapped_module: Optional[torch.nn.Module] = None
        """The module as the strategy wraps it for training (DDP, FSDP), once training is set up."""
        self.run_id: Optional[str] = None
        """This run's id (in config.yaml and every checkpoint), known once training has set up."""
        self._runner = StepRunner(module)
        self._pending_rng = PendingRng()
        self._stream_ended = False  # a stream without a length ran out in this epoch
        self._restored = False
        self._micro_batch_found = False  # gpu_batch_size_limit="auto": searched, or read from a checkpoint
        self._run_lock: Optional[RunLocks] = None  # held by rank zero while train() runs
        self._compile_started: Optional[float] = None
        self.evaluator = Evaluator(module, self._runner, self.backend, self.hooks, args, self.recorder.record)
        self.evaluation = TrainerEvaluation(  # validate, test, predict: outside training
            module,
            self.backend,
            self.checkpointer,
            args,
            self.evaluator,
            self._runner,
            self.progress,
            self.recorder,
            self.callbacks,
            self._prepare_callbacks,
            self._evaluation_batch_size,
            lambda: self._restored,
        )
        module.attach(self, self._metrics)
        seed_everything(args.seed)
        try:  # rank and world size are known; nothing is built from the module yet
            checks.check_module_setup(module)
            module.setup()
        except BaseException:
            self.backend.teardown()
            raise
        self.backend.check_module(module)  # e.g. model-parallel: a module without a tensor-parallel plan
        self.backend.convert_module(move_module(module, self.device))  # true bf16: cast before any step; meta stays

    # -- properties ---------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """Set True (from a hook) to stop training after this step, once ``min_epochs`` are done."""
        return self.stopping.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.stopping.should_stop = value

    @property
    def epoch_resumed(self) -> bool:
        """True while the current epoch is one a checkpoint resumed mid-way (False in a fresh epoch)."""
        return self.progress.epoch_resumed

    @property
    def batches_finished_in_epoch(self) -> int:
        """Micro-batches of the current epoch this rank has consumed."""
        return self.progress.batches_finished_in_epoch

    # -- training -----------------------------------------------------------------------
    def train(self) -> MetricHistory:
        """Train for ``args.epochs`` (or until ``max_steps``, ``max_time`` or a stop request).

        Raises:
            TrainingPreempted: a signal in ``preemption_signals`` arrived; the checkpoint of
                the step it stopped at is saved (an uncaught one exits with status 75).
            TrainingDiverged: the training loss became NaN/inf (``stop_on_nonfinite_loss``).
        """
        try:
            self._setup_training()
            with self.preemption, self.launcher_watch:  # a signal, or the launcher's death, stops at a step boundary
                self.hooks.call("on_begin_train", self.global_steps_finished)
                steps = self.args.sanity_val_steps  # a few val batches first; RNG restored, nothing recorded
                if sanity_check_due(steps, self.args.fast_dev_run, self.global_steps_finished):
                    run_sanity_check(lambda: self._evaluate(Stage.VAL, max_batches=steps, record=False), steps)
                save_final = True
                try:
                    while self.epochs_finished < self.args.epochs and not self._should_end_training():
                        self._train_epoch()
                except StopTraining as stop:
                    logger.info("training stopped: %s", stop)
                    save_final = stop.save_checkpoint
                if self.stopping.preempted and not self.stopping.complete(self.epochs_finished, self.global_steps_finished):
                    self._stop_for_preemption()
                self.hooks.call("on_end_train", self.global_steps_finished)
                if save_final and self.checkpointing_enabled and self.checkpointer.saves_at_end():
                    self.save_checkpoint()
                self.checkpointer.wait()
        except BaseException as error:
            self.close()
            self.loggers.finish(run_status(error))  # after the checkpoint is written
            explanation = None
            if not isinstance(error, TrainingPreempted):
                explanation = self.launcher_watch.explain(error) or self.backend.explain_failure(error)
            if explanation is not None:
                raise RuntimeError(explanation) from error
            raise
        finally:
            self.loggers.finish()
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None
        return self.history

    def _train_epoch(self) -> None:
        """One epoch: for each optimizer step, its micro-batches, the step, then what is due."""
        args, progress, checkpointing = self.args, self.progress, self.checkpointing_enabled
        run_step, stopping, hooks, checkpointer = self.training_step.run, self.stopping, self.hooks, self.checkpointer
        cycles = accumulation_cycles(
            self._micro_batches_this_epoch(), self.gradient_accumulation, progress.batches_finished_in_epoch
        )
        batches = self._start_epoch()
        self._stream_ended = False
        for cycle_length in cycles:
            micro_batches = run_step(batches, cycle_length)
            if self._compile_started is not None:
                self._report_compile_time()
            if not micro_batches:
                self._stream_ended = True
                break  # a stream without a length ran out
            progress.finish_step(micro_batches)
            step = progress.global_steps_finished
            hooks.call("on_end_optimizer_step", step)
            if step % args.log_every_n_steps == 0:
                stopping.adopt(self.recorder.log_train_metrics(stopping.flags()))  # one all-reduce
            if args.val_every_n_steps and step % args.val_every_n_steps == 0:
                self._evaluate(Stage.VAL)
            if checkpointing and checkpointer.is_step_save_due(step):
                self.save_checkpoint()
            if stopping.after_step(step, progress.epochs_finished):
                break
        self._end_epoch()

    def _report_compile_time(self) -> None:
        started, self._compile_started = self._compile_started, None
        if started is not None:
            seconds = time.perf_counter() - started
            logger.info("torch.compile: first training step (forward + backward, compilation included) took %.1f s", seconds)

    def _start_epoch(self) -> Any:
        """Position the sampler (and the RNG) where the epoch continues; ``on_begin_train_epoch``."""
        progress, loader = self.progress, self._create_train_loader()
        loader.position.start_epoch(progress.epochs_finished, progress.batches_finished_in_epoch * self.train_step_batch_size)
        # Creating a DataLoader iterator draws a seed from the global RNG. A resumed run
        # restores the saved RNG where the saved run was: before that draw at an epoch
        # boundary, after it mid-epoch.
        if progress.batches_finished_in_epoch == 0:
            self._pending_rng.apply()
            self.losses.start_epoch()
        loader.seeding.start_epoch(progress.epochs_finished)  # before iter: seeds its workers
        batches = iter(loader.loader)
        self._pending_rng.apply()
        self.training_step.kept_outputs = []
        self.hooks.call("on_begin_train_epoch", progress.global_steps_finished, progress.epochs_finished)
        return batches

    def _end_epoch(self) -> None:
        """Epoch metrics, epoch schedulers, validation and the epoch-end checkpoint."""
        progress = self.progress
        planned = self._micro_batches_this_epoch()
        epoch_completed = self._stream_ended if planned is None else progress.batches_finished_in_epoch >= planned
        if self.stopping.preempted or (not epoch_completed and self._should_end_training()):
            return  # stopped mid-epoch: the final checkpoint records the position
        self.recorder.end_train_epoch(self._call_end_train_epoch)
        every = self.args.val_every_n_epochs
        if (
            every
            and (progress.epochs_finished + 1) % every == 0
            and progress.last_validated_step != progress.global_steps_finished
        ):
            self._evaluate(Stage.VAL)
        if self.automatic_optimization:  # after the epoch's validation: ReduceLROnPlateau reads it
            validated = progress.last_validated_step == progress.global_steps_finished
            self.lr_schedules.step_per_epoch(progress.epochs_finished, self.history, validated)
        self.recorder.log_epoch_summary()
        progress.finish_epoch()
        self.stopping.agree()
        training_ends = progress.epochs_finished >= self.args.epochs or self._should_end_training()
        save_due = self.checkpointing_enabled and self.checkpointer.is_epoch_save_due(progress.epochs_finished)
        if save_due and not (training_ends and self.checkpointer.saves_at_end()):  # the final save covers the last epoch
            self.save_checkpoint(progress.epochs_finished, force=False)

    def _call_end_train_epoch(self) -> None:
        outputs = concatenate_outputs(self.training_step.kept_outputs)
        self.training_step.kept_outputs = []
        self.hooks.call("on_end_train_epoch", self.global_steps_finished, *outputs)

    def _should_end_training(self) -> bool:
        return self.stopping.should_end(self.epochs_finished, self.global_steps_finished)

    def _stop_for_preemption(self) -> None:
        """Save where training stopped, wait for the write, requeue the job where the scheduler
        allows it (Slurm ``--requeue``), and leave with exit status 75."""
        self._check_run_lock()  # a stop asked for by a lost lock ends here, before any message of saving
        signal_name = self.preemption.signal_name or "a signal on another rank"
        logger.warning("%s received: saving a checkpoint at step %d and exiting", signal_name, self.global_steps_finished)
        if self.checkpointing_enabled:
            self.save_checkpoint()
        self.checkpointer.wait()
        self.preemption.expect_termination()  # a requeue ends every process of the job with SIGTERM
        self.backend.barrier()  # every rank has saved before the job is requeued
        environment = self.backend.cluster_environment
        if self.is_main_process and environment.requeues and environment.requeue():
            logger.warning("requeued the job: it continues from this checkpoint when it starts again")
        raise TrainingPreempted(signal_name, self.global_steps_finished)

    # -- evaluation (framework/evaluation/trainer_evaluation.py) ------------------------
    def validate(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the validation loaders once; return the recorded metrics.

        ``checkpoint``: None evaluates the current weights; ``"last"``, ``"best"`` or a path
        loads those weights first, the same file on every rank (see ``docs/evaluation.md``).
        """
        return self.evaluation.validate(checkpoint)

    def test(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the test loaders once; return the recorded metrics (``checkpoint`` as in :meth:`validate`)."""
        return self.evaluation.test(checkpoint)

    def predict(self, checkpoint: Optional[str] = None, predictions_dir: Optional[str] = None) -> Any:
        """Run ``predict_step`` on every sample of ``get_predict_dataloader`` once across ranks.

        Rank zero returns the outputs in dataset order (the other ranks None); with
        ``predictions_dir`` every rank writes its batches there as it goes and rank zero returns
        the directory (read it with :func:`framework.evaluation.prediction.load_predictions`).
        ``checkpoint`` as in :meth:`validate`. Collective under DDP: call it on every rank.
        """
        return self.evaluation.predict(checkpoint, predictions_dir)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``checkpointer_args.metric``, on every rank (collective under DDP)."""
        return self.evaluation.best_checkpoint()

    def load_checkpoint_weights(self, checkpoint: Optional[str], method: str) -> Optional[str]:
        """Load the weights ``checkpoint`` names (None: keep the current ones; ``"best"``, ``"last"``,
        a path) on every rank; the URL loaded. ``method`` names the caller in messages."""
        return self.evaluation.load_checkpoint_weights(checkpoint, method)

    def export_weights(self, path: str, checkpoint: Optional[str] = None, max_shard_size: Union[int, str, None] = None) -> str:
        """Write the module's ``state_dict()`` as ``.safetensors`` (sharded above ``max_shard_size``,
        e.g. ``"5GB"``) or ``.pt`` on rank zero; return where it went. ``checkpoint`` as in
        :meth:`validate`; under fsdp the shards are gathered. Collective: call on every rank
        (see ``docs/export.md``)."""
        return export.export_weights(self, path, checkpoint, max_shard_size)

    def export_pretrained(
        self,
        directory: str,
        attribute: Optional[str] = None,
        checkpoint: Optional[str] = None,
        max_shard_size: Union[int, str, None] = "5GB",
    ) -> str:
        """Write the module's ``transformers`` model as ``save_pretrained`` does (its own keys,
        ``config.json``, HF's shard names), so ``from_pretrained(directory)`` loads it; return
        ``directory``. Collective: call on every rank (see ``docs/from-transformers.md``)."""
        from framework.integrations.transformers import export_pretrained

        return export_pretrained(self, directory, attribute, checkpoint, max_shard_size)

    def export(
        self, path: str, example_inputs: Tuple[Any, ...], format: str = "torch.export", checkpoint: Optional[str] = None
    ) -> str:
        """Export the module's ``forward`` for inference: ``"torch.export"`` (a ``.pt2`` program) or
        ``"onnx"``, traced with ``example_inputs``, on rank zero; ``checkpoint`` as in :meth:`validate`.
        Collective: call on every rank (see ``docs/export.md``)."""
        return export.export_program(self, path, example_inputs, format, checkpoint)

    def _evaluation_batch_size(self) -> int:
        return self.args.val_batch_size or self.train_step_batch_size

    def _evaluate(self, stage: Stage, max_batches: Optional[int] = None, record: bool = True) -> Dict[str, float]:
        """The loop's validation: recorded, then the schedulers that step after it (``record=False``: neither)."""
        progress = self.progress
        results = self.evaluator.run(stage, progress.global_steps_finished, self._evaluation_batch_size(), max_batches, record)
        if record and stage is Stage.VAL:
            progress.last_validated_step = progress.global_steps_finished
            if self.automatic_optimization:
                self.lr_schedules.step_after_validation(progress.global_steps_finished, self.history)
        return results

    # -- metrics --------------------------------------------------------------------------
    def log_metrics(self, metrics: Dict[str, float]) -> None:
        """Record host-side values now (history, loggers on rank zero, ``on_log_metrics`` hooks).

        For callbacks (``LearningRateMonitor``, ``Timer``); call it on every rank with the
        same names. Not from ``on_log_metrics`` itself, which it calls.
        """
        self.recorder.record({name: float(value) for name, value in metrics.items()})

    def close(self) -> None:
        """Wait for background saves and leave the process group."""
        try:
            self.checkpointer.wait()
        finally:
            self.backend.teardown()
