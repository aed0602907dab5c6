"""Trainer: the training loop, in one place."""

import dataclasses
import logging
import math
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import DataLoader

from backends import TrainerBackend, build_backend, map_tensors
from backends.activation_checkpointing import checkpoint_units
from framework import export
from framework.callbacks.base import Callback, StopTraining
from framework.callbacks.defaults import with_default_callbacks
from framework.checkpoint import AbstractCheckpointer
from framework.checkpoint.default import default_checkpointer
from framework.data.loader_plan import RecordingSampler, warn_about_stream_shares, warn_if_loader_ignores_plan
from framework.data.loader_position import LoaderPosition
from framework.data.rng import seed_everything
from framework.data.sample_randomness import LoaderSeeding
from framework.evaluation.loops import Evaluator
from framework.evaluation.prediction import Predictor
from framework.evaluation.weights import best_checkpoint_url, load_evaluation_weights
from framework.loggers import LoggerSet, RunInfo, build_loggers, run_status
from framework.loop.hooks import HookDispatcher
from framework.loop.manual_optimization import ManualOptimization
from framework.loop.micro_batch_search import search_micro_batch
from framework.loop.schedule_errors import explain_exhausted_schedule
from framework.loop.schedulers import LRSchedules, build_optimizers_schedules
from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs, concatenate_outputs
from framework.loop.tbptt import split_along_time
from framework.loop.trainer_checkpoints import TrainerCheckpoints
from framework.loop.training_state import PendingRng, TrainingProgress, accumulation_cycles
from framework.metrics.collector import MetricCollector, MetricHistory, reduce_metrics
from framework.metrics.loss_tracker import LossTracker, TrainingDiverged
from framework.module import ModuleInterface, StepRunner
from framework.run import checks
from framework.run.arguments import TrainerArguments, micro_batch_plan
from framework.run.config import resolved_config
from framework.run.launcher_watch import LauncherWatch
from framework.run.logging_setup import configure_logging
from framework.run.preemption import PreemptionHandler, TrainingPreempted, parse_signals
from framework.run.run_directory import claim_run_directory
from framework.run.run_identity import StartingIdentity
from framework.run.run_lock import RunLock, claim_run_lock
from framework.run.run_start import log_run_start

logger = logging.getLogger("framework")


class Trainer(TrainerCheckpoints):
    """Runs epochs of a :class:`ModuleInterface` on a :class:`TrainerBackend`.

    The loop in :meth:`_train_epoch` reads like a hand-written PyTorch loop: for each
    optimizer step, its micro-batches (forward and backward, all but the last under
    ``no_sync``), then unscale, clip, step and zero; then log if due, validate if due, save
    if due. Losses stay on the device and are read back only every ``log_every_n_steps``.
    With ``automatic_optimization = False`` the module's ``train_step`` does its own
    backward passes and steps (see ``docs/manual-optimization.md``).

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
                args.train_batch_size, self.backend.world_size, args.gpu_batch_size_limit
            )
            self.automatic_optimization = _check_optimization_mode(module, args, self.gradient_accumulation)
            self.loggers = LoggerSet(build_loggers(args), active=self.backend.is_main_process and not args.fast_dev_run)
        except Exception:
            self.backend.teardown()
            raise
        self.checkpointer = default_checkpointer(  # writes and reads through the strategy
            self.backend.strategy, checkpointer, args.checkpointer_args, default_dir=os.path.join(args.output_dir, "checkpoints")
        )
        self.callbacks: List[Callback] = with_default_callbacks(callbacks, args)  # + ModelSummary, ProgressBar
        self.hooks = HookDispatcher(module, self.callbacks)
        self.history = MetricHistory()
        self.progress = TrainingProgress()
        self.losses = LossTracker(self.device)
        self.should_stop = False
        self.optimizers: List[torch.optim.Optimizer] = []
        self.schedulers: List[Any] = []
        self.lr_schedules = LRSchedules()  # the schedulers with when each steps (framework/loop/schedulers.py)
        self.manual_optimization: Optional[ManualOptimization] = None
        self._train_loader: Optional[DataLoader] = None
        self._loader_length: Optional[int] = None
        self._loader_position: Optional[LoaderPosition] = None
        self._loader_seeding: Optional[LoaderSeeding] = None  # loader seeds and sample_generator's epoch
        self._stream_ended = False  # a stream without a length ran out in this epoch
        self._runner = StepRunner(module)
        self._wrapped: Optional[torch.nn.Module] = None
        self._parameters: List[torch.nn.Parameter] = []
        self._metrics = MetricCollector()
        self._kept_outputs: List[Tuple[Any, ...]] = []
        self._pending_rng = PendingRng()
        self._restored = False
        self._micro_batch_found = False  # gpu_batch_size_limit="auto": searched, or read from a checkpoint
        self._run_lock: Optional[RunLock] = None  # held by rank zero while train() runs
        self.run_id: Optional[str] = None
        """This run's id (in config.yaml and every checkpoint), known once training has set up."""
        self._closure_optimizers = False
        self._time_is_up = False  # agreed by every rank, like _preempted
        self._preempted = False
        self._start_time = 0.0
        self._first_loss_checked = False
        self._device = self.backend.device
        self._distributed = self.backend.world_size > 1
        self._forward: Any = None  # the per-step call, chosen by the backend once the module is wrapped
        self._compile_started: Optional[float] = None
        self.evaluator = Evaluator(module, self._runner, self.backend, self.hooks, args, self._record)
        module.__dict__["_metric_logger"] = self._metrics
        module.__dict__["_trainer"] = self
        seed_everything(args.seed)
        try:  # rank and world size are known; nothing is built from the module yet
            checks.check_module_setup(module)
            module.setup()
        except BaseException:
            self.backend.teardown()
            raise
        self.backend.precision.convert_module(module.to(self.device))  # true bf16: cast before any step

    # -- properties ---------------------------------------------------------------------
    @property
    def epoch_resumed(self) -> bool:
        """True while the current epoch is one a checkpoint resumed mid-way (False in a fresh epoch)."""
        return self.progress.epoch_resumed

    @property
    def batches_finished_in_epoch(self) -> int:
        """Micro-batches of the current epoch this rank has consumed."""
        return self.progress.batches_finished_in_epoch

    @property
    def estimated_global_steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps per epoch: exact when the train loader has a length, else None
        (or ``max_train_steps_per_epoch`` when that is an int). A last, partial accumulation
        cycle counts as a step."""
        self._create_train_loader()
        limit = self.args.max_train_steps_per_epoch
        if self._loader_length is None:
            return limit if isinstance(limit, int) else None
        steps = math.ceil(self._loader_length / self.gradient_accumulation)
        if isinstance(limit, float):
            return max(1, math.floor(limit * steps))
        return min(steps, limit) if limit is not None else steps

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
                if self.args.sanity_val_steps and self.global_steps_finished == 0:
                    self._evaluate(Stage.VAL, max_batches=self.args.sanity_val_steps, record=False)
                save_final = True
                try:
                    while self.epochs_finished < self.args.epochs and not self._should_end_training():
                        self._train_epoch()
                except StopTraining as stop:
                    logger.info("training stopped: %s", stop)
                    save_final = stop.save_checkpoint
                if self._preempted and not self._training_complete():
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
                explanation = self.launcher_watch.explain(error) or self.backend.strategy.explain_failure(error)
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
        cycles = accumulation_cycles(
            self._micro_batches_this_epoch(), self.gradient_accumulation, progress.batches_finished_in_epoch
        )
        batches = self._start_epoch()
        self._stream_ended = False
        for cycle_length in cycles:
            micro_batches = self._train_step(batches, cycle_length)
            if self._compile_started is not None:
                self._report_compile_time()
            if not micro_batches:
                self._stream_ended = True
                break  # a stream without a length ran out
            progress.finish_step(micro_batches)
            step = progress.global_steps_finished
            self.hooks.call("on_end_optimizer_step", step)
            if step % args.log_every_n_steps == 0:
                self._log_train_metrics()
            if args.val_every_n_steps and step % args.val_every_n_steps == 0:
                self._evaluate(Stage.VAL)
            if checkpointing and self.checkpointer.is_step_save_due(step):
                self.save_checkpoint()
            if self._should_stop_after_step(step):
                break
        self._end_epoch()

    def _report_compile_time(self) -> None:
        started, self._compile_started = self._compile_started, None
        if started is not None:
            seconds = time.perf_counter() - started
            logger.info("torch.compile: first training step (forward + backward, compilation included) took %.1f s", seconds)

    def _train_step(self, batches: Iterator[Any], cycle_length: int) -> int:
        """Forward and backward of up to ``cycle_length`` micro-batches, then one optimizer
        step; returns how many micro-batches there were (0: the stream had ended)."""
        if not self.automatic_optimization:
            batch = self._next_batch(batches)
            if batch is None:
                return 0
            step = self.progress.global_steps_finished
            self._after_micro_batch(as_outputs(self._forward(Stage.TRAIN, step, batch, self._device), "train_step"))
            return 1
        if self._closure_optimizers:
            batch = self._next_batch(batches)
            if batch is None:
                return 0
            self._after_micro_batch(self._closure_optimizer_step(batch))
            return 1
        seen = 0
        sync_every_batch = self._loader_length is None  # the last micro-batch of a stream is not known ahead
        for index in range(cycle_length):
            batch = self._next_batch(batches)
            if batch is None:
                break
            sync = sync_every_batch or index + 1 == cycle_length
            self._after_micro_batch(self._forward_backward(batch, cycle_length, sync))
            seen += 1
        if seen and seen < cycle_length:  # a stream ended inside the cycle: mean over what was seen
            for parameter in self._parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(cycle_length / seen)
        if seen:
            self._optimizer_step()
        return seen

    def _next_batch(self, batches: Iterator[Any]) -> Any:
        batch = next(batches, None)
        if self._loader_length is None and not self.backend.strategy.all_ranks_have_batch(batch is not None):
            return None  # every rank stops when the first runs out (the others would wait in an all-reduce)
        return None if batch is None else self.backend.move_to_device(batch)

    def _forward_backward(self, batch: Any, cycle_length: int, sync: bool) -> Tuple[Any, ...]:
        """Forward and backward of one micro-batch; with ``tbptt_steps``, chunk by chunk along
        dim 1, carrying the (detached) hidden state and summing the chunks' gradients."""
        step, device, wrapped = self.progress.global_steps_finished, self._device, self._wrapped
        if not self.args.tbptt_steps:
            with self.backend.no_sync(wrapped, skip_gradient_sync=not sync):
                outputs = as_outputs(self._forward(Stage.TRAIN, step, batch, device), "train_step")
                if not self._first_loss_checked:
                    self._check_first_loss(outputs[0])
                self.backend.backward(outputs[0] / cycle_length if cycle_length > 1 else outputs[0])
            self.hooks.call("on_end_backward", step, outputs[0])
            return outputs
        chunks = split_along_time(batch, self.args.tbptt_steps)
        hiddens, total_loss = None, 0.0
        for index, chunk in enumerate(chunks):
            with self.backend.no_sync(wrapped, skip_gradient_sync=not sync or index + 1 < len(chunks)):
                outputs = as_outputs(self._forward(Stage.TRAIN, step, chunk, device, hiddens), "train_step")
                if len(outputs) < 2:
                    raise TypeError(
                        "with tbptt_steps set, train_step(global_step, batch, device, hiddens) must return (loss, hiddens, ...)"
                    )
                if not self._first_loss_checked:
                    self._check_first_loss(outputs[0])
                self.backend.backward(outputs[0] / (cycle_length * len(chunks)))
            self.hooks.call("on_end_backward", step, outputs[0])
            hiddens = map_tensors(outputs[1], torch.Tensor.detach)
            total_loss = total_loss + outputs[0].detach()
        return (total_loss / len(chunks), *outputs[1:])

    def _check_first_loss(self, loss: torch.Tensor) -> None:
        checks.check_loss_requires_grad(loss, self.module)
        self._first_loss_checked = True

    def _after_micro_batch(self, outputs: Tuple[Any, ...]) -> None:
        """Keep the loss on the device (and the outputs when asked); ``on_end_train_step``."""
        step = self.progress.global_steps_finished
        self.losses.add(outputs[0], step)
        if self.args.collect_train_outputs:
            self._kept_outputs.append(map_tensors(outputs, torch.Tensor.detach))
        self.hooks.call("on_end_train_step", step, *outputs)

    def _closure_optimizer_step(self, batch: Any) -> Tuple[Any, ...]:
        """One step of optimizers that re-evaluate the loss themselves (LBFGS)."""
        first_outputs: List[Tuple[Any, ...]] = []
        step = self.global_steps_finished

        def closure() -> torch.Tensor:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=False)
            outputs = as_outputs(self._forward(Stage.TRAIN, step, batch, self._device), "train_step")
            if not self._first_loss_checked:
                self._check_first_loss(outputs[0])
            self.backend.backward(outputs[0])
            self._clip_gradients()
            if not first_outputs:
                first_outputs.append(outputs)
                self.hooks.call("on_end_backward", step, outputs[0])
            return outputs[0]

        self._optimizer_step(closure)
        return first_outputs[0]

    def _optimizer_step(self, closure: Any = None) -> None:
        """Unscale, clip, step optimizers (and per-step schedulers), zero gradients."""
        args = self.args
        if closure is None:
            self.backend.unscale_gradients(self.optimizers)
            if args.clip_grads or args.track_grad_norm or args.clip_grad_value is not None:
                self._clip_gradients()
        stepped = self.backend.step_optimizers(self.optimizers, closure)
        if stepped and self.schedulers:
            try:
                self.lr_schedules.step_per_optimizer_step(self.progress.global_steps_finished + 1)
            except ValueError as error:
                explain_exhausted_schedule(error, self)  # OneCycleLR past total_steps: an extended resumed run
                raise
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _clip_gradients(self) -> None:
        args = self.args
        if args.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(self._parameters, args.clip_grad_value)
        if args.clip_grads or args.track_grad_norm:
            max_norm = args.max_grad_norm if args.clip_grads else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters, max_norm)
            if args.track_grad_norm:
                self._metrics.log("grad_norm", grad_norm, on_step=True, on_epoch=True)

    def _start_epoch(self) -> Iterator[Any]:
        """Position the sampler (and the RNG) where the epoch continues; ``on_begin_train_epoch``."""
        progress = self.progress
        self._loader_position.start_epoch(
            progress.epochs_finished, progress.batches_finished_in_epoch * self.train_step_batch_size
        )
        # Creating a DataLoader iterator draws a seed from the global RNG. A resumed run
        # restores the saved RNG where the saved run was: before that draw at an epoch
        # boundary, after it mid-epoch.
        if progress.batches_finished_in_epoch == 0:
            self._pending_rng.apply()
            self.losses.start_epoch()
        self._loader_seeding.start_epoch(progress.epochs_finished)  # before iter: seeds its workers
        batches = iter(self._train_loader)
        self._pending_rng.apply()
        self._kept_outputs = []
        self.hooks.call("on_begin_train_epoch", progress.global_steps_finished, progress.epochs_finished)
        return batches

    def _end_epoch(self) -> None:
        """Epoch metrics, epoch schedulers, validation and the epoch-end checkpoint."""
        progress = self.progress
        planned = self._micro_batches_this_epoch()
        epoch_completed = self._stream_ended if planned is None else progress.batches_finished_in_epoch >= planned
        if self._preempted or (not epoch_completed and self._should_end_training()):
            return  # stopped mid-epoch: the final checkpoint records the position
        self._end_train_epoch()
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
        self._log_epoch_summary()
        progress.finish_epoch()
        self._agree_on_stopping()
        training_ends = progress.epochs_finished >= self.args.epochs or self._should_end_training()
        save_due = self.checkpointing_enabled and self.checkpointer.is_epoch_save_due(progress.epochs_finished)
        if save_due and not (training_ends and self.checkpointer.saves_at_end()):  # the final save covers the last epoch
            self.save_checkpoint(index=progress.epochs_finished, force=False)

    def _end_train_epoch(self) -> None:
        mean_loss = self.losses.epoch_mean()
        if mean_loss is not None:
            self._record_train_loss("train_loss_epoch", float(self.backend.all_reduce(mean_loss)))
        outputs = concatenate_outputs(self._kept_outputs)
        self._kept_outputs = []
        self.hooks.call("on_end_train_epoch", self.global_steps_finished, *outputs)
        self._record(self._reduce_collected(self._metrics.pop_epoch(), agree_on_names=True))  # from steps and the hook above

    def _log_epoch_summary(self) -> None:
        epoch = self.epochs_finished
        latest = {r["name"]: r["value"] for r in self.history.records if r["epoch"] == epoch and r["name"] != "train_loss"}
        summary = "  ".join(f"{name}={value:.4g}" for name, value in latest.items())
        logger.info("epoch %d/%d (step %d): %s", epoch + 1, self.args.epochs, self.global_steps_finished, summary)

    # -- stopping -----------------------------------------------------------------------
    def _should_stop_after_step(self, step: int) -> bool:
        """After each optimizer step: max_steps, max_time, a signal, or a stop request.

        Every rank must answer the same. ``max_steps`` is the same everywhere; at log points
        the ranks' requests rode on the loss all-reduce; between them, the clock and signals
        are agreed on by the strategy, with no collective while nothing is pending here.
        """
        args = self.args
        if args.max_steps is not None and step >= args.max_steps:
            return True
        if not self._distributed:
            self._time_is_up = self._time_is_up or (args.max_time is not None and self._clock_expired())
            self._preempted = self.preemption.requested
            return self._time_is_up or self._preempted or (self.should_stop and self._should_end_training())
        if step % args.log_every_n_steps == 0:
            return self._should_end_training()
        pending = self.preemption.requested or self._clock_expired()
        if pending and self.backend.strategy.preemption_agreed(True, step):
            self._agree_on_stopping()  # once, at the agreed step: every rank learns every reason
            return True
        return False

    def _clock_expired(self) -> bool:
        max_time = self.args.max_time
        return max_time is not None and time.monotonic() - self._start_time > max_time

    def _stop_flags(self) -> List[bool]:
        """This rank's stop request, expired clock and pending signal."""
        return [self.should_stop, self._time_is_up or self._clock_expired(), self.preemption.requested]

    def _agree_on_stopping(self) -> None:
        """Every rank adopts any rank's stop request, expired clock and signal (one tiny all-reduce)."""
        self.should_stop, self._time_is_up, self._preempted = self.backend.strategy.any_rank(self._stop_flags())

    def _should_end_training(self) -> bool:
        args = self.args
        if self._training_complete() or self._time_is_up or self._preempted:
            return True
        return self.should_stop and self.epochs_finished >= args.min_epochs

    def _training_complete(self) -> bool:
        max_steps = self.args.max_steps
        return self.epochs_finished >= self.args.epochs or (max_steps is not None and self.global_steps_finished >= max_steps)

    def _stop_for_preemption(self) -> None:
        """Save where training stopped, wait for the write, requeue the job where the scheduler
        allows it (Slurm ``--requeue``), and leave with exit status 75."""
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

    # -- evaluation ---------------------------------------------------------------------
    def validate(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the validation loaders once; return the recorded metrics.

        ``checkpoint``: None evaluates the current weights; ``"last"``, ``"best"`` or a path
        loads those weights first, the same file on every rank (see ``docs/evaluation.md``).
        """
        return self._standalone_evaluation(Stage.VAL, checkpoint)

    def test(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the test loaders once; return the recorded metrics (``checkpoint`` as in :meth:`validate`)."""
        return self._standalone_evaluation(Stage.TEST, checkpoint)

    def predict(self, checkpoint: Optional[str] = None, predictions_dir: Optional[str] = None) -> Any:
        """Run ``predict_step`` on every sample of ``get_predict_dataloader`` once across ranks.

        Rank zero returns the outputs in dataset order (the other ranks None); with
        ``predictions_dir`` every rank writes its batches there as it goes and rank zero returns
        the directory (read it with :func:`framework.evaluation.prediction.load_predictions`).
        ``checkpoint`` as in :meth:`validate`. Collective under DDP: call it on every rank.
        """
        load_evaluation_weights(self, checkpoint, "predict")
        batch_size = self.args.val_batch_size or self.train_step_batch_size
        return Predictor(self.module, self.backend, self.args).run(self.global_steps_finished, batch_size, predictions_dir)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``checkpointer_args.metric``, on every rank (collective under DDP)."""
        return best_checkpoint_url(self.checkpointer, self.backend)

    def export_weights(self, path: str, checkpoint: Optional[str] = None, max_shard_size: Union[int, str, None] = None) -> str:
        """Write the module's ``state_dict()`` as ``.safetensors`` (sharded above ``max_shard_size``,
        e.g. ``"5GB"``) or ``.pt`` on rank zero; return where it went. ``checkpoint`` as in
        :meth:`validate`; under fsdp the shards are gathered. Collective: call on every rank
        (see ``docs/export.md``)."""
        return export.export_weights(self, path, checkpoint, max_shard_size)

    def export(
        self, path: str, example_inputs: Tuple[Any, ...], format: str = "torch.export", checkpoint: Optional[str] = None
    ) -> str:
        """Export the module's ``forward`` for inference: ``"torch.export"`` (a ``.pt2`` program) or
        ``"onnx"``, traced with ``example_inputs``, on rank zero; ``checkpoint`` as in :meth:`validate`.
        Collective: call on every rank (see ``docs/export.md``)."""
        return export.export_program(self, path, example_inputs, format, checkpoint)

    def _standalone_evaluation(self, stage: Stage, checkpoint: Optional[str] = None) -> Dict[str, float]:
        load_evaluation_weights(self, checkpoint, "validate" if stage is Stage.VAL else "test")
        self._prepare_callbacks()
        self._start_loggers()
        try:  # no scheduler steps, no progress counters: this is not training
            batch_size = self.args.val_batch_size or self.train_step_batch_size
            return self.evaluator.run(stage, self.global_steps_finished, batch_size)
        finally:
            self.loggers.finish()

    def _evaluate(self, stage: Stage, max_batches: Optional[int] = None, record: bool = True) -> Dict[str, float]:
        batch_size = self.args.val_batch_size or self.train_step_batch_size
        results = self.evaluator.run(stage, self.global_steps_finished, batch_size, max_batches, record)
        if record and stage is Stage.VAL:
            self.progress.last_validated_step = self.global_steps_finished
            if self.automatic_optimization:
                self.lr_schedules.step_after_validation(self.global_steps_finished, self.history)
        return results

    # -- metrics --------------------------------------------------------------------------
    def _log_train_metrics(self) -> None:
        """Read the loss since the last log point (and logged step values) back from the device,
        with the ranks' stop requests riding on the same all-reduce, and write them."""
        has_loss = self.losses.has_unlogged
        interval_mean = self.losses.interval_mean().float().reshape(1)
        flags = torch.tensor([float(flag) for flag in self._stop_flags()], device=self.device)
        loss, *any_flags = self.backend.all_reduce(torch.cat([interval_mean, flags])).tolist()
        self.should_stop, self._time_is_up, self._preempted = (flag > 0 for flag in any_flags)  # any rank asked
        self.losses.mark_logged()
        if has_loss:
            self._record_train_loss("train_loss", loss)
        self._record(self._reduce_collected(self._metrics.pop_step()))

    def _record_train_loss(self, name: str, value: float) -> None:
        """Record a training loss read back from the device; a NaN/inf one ends the run (unless a
        GradScaler skips such steps: then it never reached the weights)."""
        if not math.isfinite(value) and self.args.stop_on_nonfinite_loss and not self.backend.precision.skips_nonfinite_steps:
            first = self.losses.first_nonfinite_step()
            first = self.backend.strategy.min_over_ranks(first if first is not None else 2**62)
            raise TrainingDiverged(first, value)
        self._record({name: value})

    def _reduce_collected(self, collected: Dict[str, Tuple[Any, ...]], agree_on_names: bool = False) -> Dict[str, float]:
        gather = self.backend.all_gather_object if agree_on_names else None  # once per epoch: a rank may have logged nothing
        return reduce_metrics(collected, self.backend.all_reduce, self.device, gather)

    def log_metrics(self, metrics: Dict[str, float]) -> None:
        """Record host-side values now (history, loggers on rank zero, ``on_log_metrics`` hooks).

        For callbacks (``LearningRateMonitor``, ``Timer``); call it on every rank with the
        same names. Not from ``on_log_metrics`` itself, which it calls.
        """
        self._record({name: float(value) for name, value in metrics.items()})

    def _record(self, metrics: Dict[str, float]) -> None:
        if not metrics:
            return
        records = [
            self.history.add(name, value, self.global_steps_finished, self.epochs_finished) for name, value in metrics.items()
        ]
        self.loggers.log(records)  # rank zero
        self.hooks.call("on_log_metrics", self.global_steps_finished, dict(metrics))

    def _start_loggers(self) -> None:
        """Start the loggers (rank zero) with the history so far; a later validate()/test() starts them again."""
        args = self.args
        self.loggers.start(lambda: RunInfo(args.output_dir, resolved_config(args).to_dict(), list(self.history.records)))

    # -- setup ----------------------------------------------------------------------------
    def _create_train_loader(self) -> None:
        if self._train_loader is not None:
            return
        sampler = RecordingSampler(self.backend.sampler_factory(shuffle=True, seed=self.args.seed))
        loader = self.module.get_train_dataloader(sampler, self.train_step_batch_size)
        checks.check_train_dataloader(loader)
        warn_if_loader_ignores_plan(
            loader, sampler, self.train_step_batch_size, self.backend.world_size, self.gradient_accumulation
        )
        self._train_loader = self.backend.prepare_loader(loader)
        try:
            length: Optional[int] = len(self._train_loader)
        except TypeError:
            length = None
        self._loader_length = None if length is None else self.backend.strategy.min_over_ranks(length)
        warn_about_stream_shares(self._train_loader, self.backend.world_size, self.backend.all_gather_object)
        checks.check_train_loader_not_empty(self._train_loader, self._loader_length, self.train_step_batch_size)
        self._loader_position = LoaderPosition(self._train_loader)
        self._loader_seeding = LoaderSeeding(self._train_loader, self.args.seed)

    def _setup_training(self) -> None:
        if not self.args.fast_dev_run:  # first: a second live run on this output_dir stops here
            self._run_lock = claim_run_lock(self.args.output_dir, self.backend)
        self._create_train_loader()
        if self._wrapped is None:
            if self.args.activation_checkpointing:  # before the strategy compiles and shards the units
                checkpoint_units(self.module)
            self._wrapped = self.backend.wrap_module(self._runner)
            self._forward = self.backend.step_function(self._wrapped, self._runner)
            self._parameters = [p for p in self.module.parameters() if p.requires_grad]
        if not self.optimizers:
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
            self._closure_optimizers = any(isinstance(o, torch.optim.LBFGS) for o in self.optimizers)
            self._check_closure_optimizers()
            if not self.automatic_optimization:
                self.manual_optimization = ManualOptimization(
                    self.backend,
                    self.optimizers,
                    self.schedulers,
                    self._wrapped,
                    on_backward=lambda loss: self.hooks.call("on_end_backward", self.global_steps_finished, loss),
                )
        self._prepare_callbacks()
        if not self._restored:
            self._restored = True
            log_run_start(self)  # checkpoint retention; ddp as one process
            if self.checkpointing_enabled:
                self._loader_position.warn_if_not_resumable()
                self._loader_seeding.warn_about_worker_randomness(self._loader_position.resumable_mid_epoch)
            if not self.args.fast_dev_run:  # before anything is written: never overwrite another run's files
                claim_run_directory(self.args.output_dir, self.checkpointer, self.backend)
            self._identity = StartingIdentity.read(self.args.output_dir, self.backend)
            self._restore_checkpoint()  # sets run_id: the resumed run's, or a new one
            if self.args.gpu_batch_size_limit == "auto" and not self._micro_batch_found:
                self._use_micro_batch(search_micro_batch(self), "the largest that fits")
        self._start_loggers()
        if self.is_main_process and not self.args.fast_dev_run:
            resolved_config(self.args).save(os.path.join(self.args.output_dir, "config.yaml"), run_id=self.run_id)
        self._start_time = time.monotonic()
        self._compile_started = time.perf_counter() if self.args.compile else None
        self.module.train()

    def _check_closure_optimizers(self) -> None:
        if self._closure_optimizers and (self.gradient_accumulation > 1 or self.args.tbptt_steps):
            raise ValueError(
                "LBFGS re-evaluates the loss itself: it needs gradient_accumulation == 1 (gpu_batch_size_limit "
                f"unset or >= the per-process batch, got accumulation {self.gradient_accumulation}) and no tbptt_steps"
            )

    def _use_micro_batch(self, size: int, why: str) -> None:
        """``gpu_batch_size_limit="auto"``: train with micro-batches of ``size``, accumulating the
        rest of the batch (the global batch does not change), from a train loader of that size."""
        plan = micro_batch_plan(self.args.train_batch_size, self.backend.world_size, size)
        if plan != (self.train_step_batch_size, self.gradient_accumulation):
            self.train_step_batch_size, self.gradient_accumulation = plan
            self._train_loader = None
            self._create_train_loader()
            self._check_closure_optimizers()
        self._micro_batch_found = True
        logger.info("gpu_batch_size_limit='auto': micro-batch %d, gradient accumulation %d (%s)", *plan, why)

    def _use_saved_micro_batch(self, saved: Any) -> None:
        """Adopt the micro-batch a checkpoint was trained with, unless it does not divide this run's
        per-process batch (another world size): then the search runs again."""
        per_process = self.args.train_batch_size // self.backend.world_size
        if isinstance(saved, int) and 0 < saved <= per_process and per_process % saved == 0:
            self._use_micro_batch(saved, "from the checkpoint")

    def _micro_batches_this_epoch(self) -> Optional[int]:
        steps = self.estimated_global_steps_per_epoch
        if steps is None:
            return None
        if self._loader_length is None:
            return steps * self.gradient_accumulation
        return min(self._loader_length, steps * self.gradient_accumulation)

    def _prepare_callbacks(self) -> None:
        """Hand each callback the trainer; look hooks up afresh (callbacks may have changed)."""
        for callback in self.callbacks:
            callback.setup(self)
        checks.check_hook_signatures(self.module, *self.callbacks)
        self.hooks.refresh()

    def close(self) -> None:
        """Wait for background saves and leave the process group."""
        try:
            self.checkpointer.wait()
        finally:
            self.backend.teardown()


def _check_optimization_mode(module: ModuleInterface, args: TrainerArguments, accumulation: int) -> bool:
    """The module's ``automatic_optimization``, after refusing settings manual mode cannot apply."""
    automatic = module.automatic_optimization
    if not isinstance(automatic, bool):
        raise TypeError(f"{type(module).__name__}.automatic_optimization={automatic!r}; allowed: True or False")
    if automatic:
        return True
    refused = {
        "gradient accumulation (train_batch_size / world size > gpu_batch_size_limit)": accumulation > 1,
        "gpu_batch_size_limit='auto' (it may accumulate micro-batches)": args.gpu_batch_size_limit == "auto",
        "tbptt_steps (split the batch in train_step instead)": args.tbptt_steps is not None,
        "clip_grads / clip_grad_value (call self.clip_gradients in train_step)": args.clip_grads
        or args.clip_grad_value is not None,
        "track_grad_norm (clip_gradients returns the norm: self.log it)": args.track_grad_norm,
    }
    for setting, applies in refused.items():
        if applies:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization = False), where the "
                f"trainer runs no backward and no optimizer step itself, so {setting} cannot apply; remove it"
            )
    return False
