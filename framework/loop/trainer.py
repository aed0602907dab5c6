"""Trainer: the training loop, in one place."""

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from backends import TrainerBackend
from backends.strategies.meta_init import move_module
from framework import export
from framework.callbacks.base import Callback, StopTraining
from framework.checkpoint import AbstractCheckpointer
from framework.config.arguments import TrainerArguments
from framework.config.class_path import config_data_module
from framework.config.cli import own_copy
from framework.data.data_module import DataModule, attach_data_module
from framework.data.rng import seed_everything
from framework.data.train_loader import TrainLoader
from framework.evaluation.sanity_check import run_sanity_check, sanity_check_due
from framework.lifecycle.preemption import TrainingPreempted
from framework.loggers import LoggerSet, run_status
from framework.loop import module_checks as checks
from framework.loop.manual_optimization import ManualOptimization
from framework.loop.owned_by import OwnedBy
from framework.loop.schedulers import LRSchedules
from framework.loop.stage import Stage
from framework.loop.step_outputs import concatenate_outputs
from framework.loop.trainer_parts import build_parts
from framework.loop.training_state import accumulation_cycles
from framework.metrics.collector import MetricHistory
from framework.module import ModuleInterface

logger = logging.getLogger("framework")


class Trainer:
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
        datamodule: a :class:`~framework.DataModule` serving the loaders the module lacks (None: the config's ``data:``).

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
        datamodule: Optional[DataModule] = None,
    ) -> None:
        args = args if args is not None else TrainerArguments()
        checks.check_trainer_inputs(module, args, trainer_backend)
        if args.fast_dev_run:
            args = dataclasses.replace(args, epochs=1, min_epochs=0, max_train_steps_per_epoch=1, max_val_steps_per_epoch=1)
        else:
            args = own_copy(args)  # output_dir may move to version_<N>
        self.args, self.module = args, module
        parts = build_parts(  # each part given what it needs, by keyword (framework/loop/trainer_parts.py)
            module=module, args=args, backend=trainer_backend, checkpointer=checkpointer, callbacks=callbacks, view=self
        )
        self.preemption, self.backend, self.launcher_watch = parts.preemption, parts.backend, parts.launcher_watch
        self.checkpointer, self.callbacks, self.hooks = parts.checkpointer, parts.callbacks, parts.hooks
        self.history, self.progress, self.losses = parts.history, parts.progress, parts.losses
        self.collector, self.stopping, self.recorder = parts.collector, parts.stopping, parts.recorder
        self.runner, self.training_step, self.training_setup = parts.runner, parts.training_step, parts.training_setup
        self.run_claim, self.checkpoint_manager, self.run_start = parts.run_claim, parts.checkpoint_manager, parts.run_start
        self.evaluator, self.evaluation = parts.evaluator, parts.evaluation
        self._stream_ended = False  # a stream without a length ran out in this epoch
        self._compile_started: Optional[float] = None
        module.attach(self, self.collector)
        seed_everything(args.seed)
        try:  # rank and world size are known; nothing is built from the module yet
            attach_data_module(module, config_data_module(args) if datamodule is None else datamodule, self.backend)
            checks.check_module_setup(module)
            module.setup()
        except BaseException:
            self.backend.teardown()
            raise
        self.backend.check_module(module)  # e.g. model-parallel: a module without a tensor-parallel plan
        self.backend.convert_module(move_module(module, self.device))  # true bf16: cast before any step; meta stays

    # -- what callbacks and the module read; each value has one owner, a part of the trainer ------
    device = OwnedBy[torch.device]("backend", "Where the module and batches live.")
    is_main_process = OwnedBy[bool]("backend", "True on rank zero: the rank that prints and writes files.")
    global_steps_finished = OwnedBy[int]("progress", "Optimizer steps finished (manual optimization: batches).")
    epochs_finished = OwnedBy[int]("progress", "Epochs finished.")
    epoch_resumed = OwnedBy[bool]("progress", "True while the current epoch is one a checkpoint resumed mid-way.")
    batches_finished_in_epoch = OwnedBy[int]("progress", "Micro-batches of the current epoch this rank has consumed.")
    run_id = OwnedBy[Optional[str]]("checkpoint_manager", "This run's id (config.yaml, checkpoints), once set up.")
    loggers = OwnedBy[LoggerSet]("recorder", "The run's loggers (active on rank zero).")
    sanity_checking = OwnedBy[bool]("recorder", "True during the sanity validation before training (nothing recorded).")
    # Once training is set up (train()), from configure_optimizers, get_train_dataloader and the strategy:
    optimizers = OwnedBy[List[torch.optim.Optimizer]]("training_setup", "The module's optimizers.")
    schedulers = OwnedBy[List[Any]]("training_setup", "The module's learning-rate schedulers.")
    lr_schedules = OwnedBy[LRSchedules]("training_setup", "The schedulers with when each steps.")
    manual_optimization = OwnedBy[Optional[ManualOptimization]]("training_setup", "What manual_backward goes through.")
    train_loader = OwnedBy[Optional[TrainLoader]]("training_setup", "The train loader as the backend prepared it.")
    wrapped_module = OwnedBy[Optional[torch.nn.Module]]("training_setup", "The module as the strategy wraps it (DDP, FSDP).")
    train_step_batch_size = OwnedBy[int]("training_setup", "The micro-batch per process.")
    gradient_accumulation = OwnedBy[int]("training_setup", "Micro-batches per optimizer step.")
    automatic_optimization = OwnedBy[bool]("training_setup", "False when the module steps its optimizers itself.")

    @property
    def should_stop(self) -> bool:
        """Set True (from a hook) to stop training after this step, once ``min_epochs`` are done."""
        return self.stopping.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.stopping.should_stop = value

    @property
    def checkpointing_enabled(self) -> bool:
        """False under ``fast_dev_run``."""
        return not self.args.fast_dev_run

    @property
    def estimated_global_steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps per epoch: exact when the train loader has a length, else None (or
        ``max_train_steps_per_epoch`` when that is an int); a last, partial accumulation cycle counts."""
        return self.training_setup.loader().steps_per_epoch

    # -- training -----------------------------------------------------------------------
    def train(self) -> MetricHistory:
        """Train for ``args.epochs`` (or until ``max_steps``, ``max_time`` or a stop request).

        Raises:
            TrainingPreempted: a signal in ``preemption_signals`` arrived; the checkpoint of
                the step it stopped at is saved (an uncaught one exits with status 75).
            TrainingDiverged: the training loss became NaN/inf (``stop_on_nonfinite_loss``).
        """
        try:
            self.run_start.run()
            self._compile_started = time.perf_counter() if self.args.compile else None
            with self.preemption, self.launcher_watch:  # a signal, or the launcher's death, stops at a step boundary
                self.hooks.call("on_begin_train", self.global_steps_finished)
                steps = self.args.sanity_val_steps  # a few val batches first; RNG restored, nothing recorded
                if sanity_check_due(steps, self.args.fast_dev_run, self.global_steps_finished):
                    run_sanity_check(lambda: self._evaluate(Stage.VAL, max_batches=steps, record=False), steps, self.recorder)
                save_final = True
                try:
                    while self.progress.epochs_finished < self.args.epochs and not self._should_end_training():
                        self._train_epoch()
                except StopTraining as stop:
                    logger.info("training stopped: %s", stop)
                    save_final = stop.save_checkpoint
                if self.stopping.preempted and not self.stopping.complete(self.epochs_finished, self.global_steps_finished):
                    self.run_claim.check()  # a stop asked for by a lost lock ends here, before any message of saving
                    self.preemption.stop(self.global_steps_finished, self.backend, self.checkpoint_manager.save_and_wait)
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
            self.run_claim.release()
        return self.history

    def _train_epoch(self) -> None:
        """One epoch: for each optimizer step, its micro-batches, the step, then what is due."""
        args, progress, checkpointing = self.args, self.progress, self.checkpointing_enabled
        run_step, stopping, hooks, checkpointer = self.training_step.run, self.stopping, self.hooks, self.checkpointer
        setup = self.training_setup
        cycles = accumulation_cycles(
            setup.loader().micro_batches_per_epoch, setup.gradient_accumulation, progress.batches_finished_in_epoch
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
        progress, loader = self.progress, self.training_setup.loader()
        loader.position.start_epoch(progress.epochs_finished, progress.batches_finished_in_epoch * loader.micro_batch_size)
        # Creating a DataLoader iterator draws a seed from the global RNG. A resumed run
        # restores the saved RNG where the saved run was: before that draw at an epoch
        # boundary, after it mid-epoch.
        if progress.batches_finished_in_epoch == 0:
            self.checkpoint_manager.pending_rng.apply()
            self.losses.start_epoch()
        loader.seeding.start_epoch(progress.epochs_finished)  # before iter: seeds its workers
        batches = iter(loader.loader)
        self.checkpoint_manager.pending_rng.apply()
        self.training_step.kept_outputs = []
        self.hooks.call("on_begin_train_epoch", progress.global_steps_finished, progress.epochs_finished)
        return batches

    def _end_epoch(self) -> None:
        """Epoch metrics, epoch schedulers, validation and the epoch-end checkpoint."""
        progress = self.progress
        planned = self.training_setup.loader().micro_batches_per_epoch
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
        if self.training_setup.automatic_optimization:  # after the epoch's validation: ReduceLROnPlateau reads it
            validated = progress.last_validated_step == progress.global_steps_finished
            self.training_setup.lr_schedules.step_per_epoch(progress.epochs_finished, self.history, validated)
        self.recorder.log_epoch_summary()
        progress.finish_epoch()
        self.stopping.agree()
        training_ends = progress.epochs_finished >= self.args.epochs or self._should_end_training()
        save_due = self.checkpointing_enabled and self.checkpointer.is_epoch_save_due(progress.epochs_finished)
        if save_due and not (training_ends and self.checkpointer.saves_at_end()):  # the final save covers the last epoch
            self.save_checkpoint(progress.epochs_finished, force=False)

    def _call_end_train_epoch(self) -> None:
        outputs, self.training_step.kept_outputs = concatenate_outputs(self.training_step.kept_outputs), []
        self.hooks.call("on_end_train_epoch", self.progress.global_steps_finished, *outputs)

    def _should_end_training(self) -> bool:
        return self.stopping.should_end(self.progress.epochs_finished, self.progress.global_steps_finished)

    # -- checkpoints (framework/loop/checkpoint_manager.py) ------------------------------
    def save_checkpoint(self, epoch: Optional[int] = None, force: bool = True) -> Optional[str]:
        """Save module, trainer and backend state now (``force=False``: if the schedule, asked about
        ``epoch`` epochs finished (default: now), says a save is due); where it went, or None.

        Call it on every rank, at an optimizer-step boundary (e.g. from ``on_end_optimizer_step``)
        for an exact resume. The checkpointer writes through the strategy (one file from rank zero,
        or shards from every rank); every rank raises if the save failed on any rank.
        """
        return self.checkpoint_manager.save(epoch, force)

    def save_model_checkpoint(self) -> Optional[str]:
        """Write the module's full weights alone (for inference), on rank zero (call on every rank)."""
        return self.checkpoint_manager.save_model()

    def state_dict(self) -> Dict[str, Any]:
        """Counters and the position in the epoch (the sampler is fast-forwarded to it), optimizers,
        schedulers, callbacks, history, and per rank: RNG states, running losses, logged values,
        the loader's or dataset's ``state_dict()``, and the module's ``get_state()`` entries other
        than ``"model"`` (the user's own state, e.g. a replay buffer: each rank restores its own).
        Collective under DDP (the per-rank part is gathered): call it on every rank."""
        return self.checkpoint_manager.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (optimizers must exist: call inside train)."""
        self.checkpoint_manager.load_state_dict(state)

    # -- evaluation (framework/evaluation/trainer_evaluation.py) ------------------------
    def validate(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the validation loaders once; return the recorded metrics.

        ``checkpoint``: None evaluates the current weights; ``"last"``, ``"best"`` or a path
        loads those weights first, the same file on every rank (see ``docs/evaluation.md``)."""
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
        peft_layout: str = "merged",
    ) -> str:
        """Write the module's ``transformers`` model as ``save_pretrained`` does (its own keys, ``config.json``,
        HF's shard names), so ``from_pretrained(directory)`` loads it; return ``directory``. A peft model is
        written merged, or with ``peft_layout="adapters"`` as PEFT's adapter files. Collective: call on every
        rank (see ``docs/from-transformers.md``)."""
        from framework.integrations.transformers import export_pretrained

        return export_pretrained(self, directory, attribute, checkpoint, max_shard_size, peft_layout)

    def export(
        self, path: str, example_inputs: Tuple[Any, ...], format: str = "torch.export", checkpoint: Optional[str] = None
    ) -> str:
        """Export the module's ``forward`` for inference: ``"torch.export"`` (a ``.pt2`` program) or
        ``"onnx"``, traced with ``example_inputs``, on rank zero; ``checkpoint`` as in :meth:`validate`.
        Collective: call on every rank (see ``docs/export.md``)."""
        return export.export_program(self, path, example_inputs, format, checkpoint)

    def _evaluate(self, stage: Stage, max_batches: Optional[int] = None, record: bool = True) -> Dict[str, float]:
        """The loop's validation: recorded, then the schedulers that step after it (``record=False``: neither)."""
        progress = self.progress
        results = self.evaluator.run(
            stage, progress.global_steps_finished, self.training_setup.evaluation_batch_size(), max_batches, record
        )
        if record and stage is Stage.VAL:
            progress.last_validated_step = progress.global_steps_finished
            if self.training_setup.automatic_optimization:
                self.training_setup.lr_schedules.step_after_validation(progress.global_steps_finished, self.history)
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
