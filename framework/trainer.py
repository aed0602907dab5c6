"""Trainer: the training loop, in one place."""

import dataclasses
import logging
import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from backends import TrainerBackend, build_backend, map_tensors
from framework.arguments import TrainerArguments, micro_batch_plan
from framework.callbacks.base import Callback, StopTraining
from framework.callbacks.progress import ProgressBar
from framework.checkpoint import AbstractCheckpointer, Checkpoint, DefaultCheckpointer
from framework.hooks import TrainingHooks
from framework.logging_setup import configure_logging
from framework.config import resolved_config
from framework.metrics import MetricCollector, MetricHistory, reduce_metrics
from framework.module import ModuleInterface, StepRunner, as_loader_dict
from framework.rng import capture_rng_state, restore_rng_state, seed_everything
from framework.stage import Stage
from framework.step_outputs import as_outputs, concatenate_outputs, interleave_ranks
from framework.tbptt import split_along_time
from framework.writers import CSVWriter, MetricWriter, TensorBoardWriter

logger = logging.getLogger("framework")

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


class Trainer:
    """Runs epochs of a :class:`ModuleInterface` on a :class:`TrainerBackend`.

    The loop in :meth:`train` reads like a hand-written PyTorch loop: for each micro-batch,
    forward and backward (under ``no_sync`` until the last micro-batch of an accumulation
    cycle); then unscale, clip, step the optimizers and schedulers, zero the gradients.
    Losses stay on the device and are read back only every ``log_every_n_steps``.

    Args:
        module: the user's module.
        args: run arguments (default: ``TrainerArguments()``).
        trainer_backend: a backend instance; None builds ``args.backend`` by name.
        checkpointer: None uses a :class:`DefaultCheckpointer` from ``args.checkpointer_args``.
        callbacks: called after the module's own hooks, in this order. A progress bar is
            added unless ``args.disable_tqdm`` or one is given.

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
        self.backend = trainer_backend if trainer_backend is not None else build_backend(args.backend)
        self.backend.setup(
            use_gpu=args.use_gpu,
            amp_dtype=args.amp_dtype,
            find_unused_parameters=args.find_unused_parameters,
            ddp_timeout=args.ddp_timeout,
            cluster=args.cluster,
        )
        try:
            configure_logging(args.log_level, self.backend.is_main_process)
            self.train_step_batch_size, self.gradient_accumulation = micro_batch_plan(
                args.train_batch_size, self.backend.world_size, args.gpu_batch_size_limit
            )
        except Exception:
            self.backend.teardown()
            raise
        self.checkpointer = checkpointer if checkpointer is not None else DefaultCheckpointer(
            args.checkpointer_args, default_dir=os.path.join(args.output_dir, "checkpoints")
        )
        self.callbacks: List[Callback] = list(callbacks)
        if not args.disable_tqdm and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.insert(0, ProgressBar())
        self.history = MetricHistory()
        self.writers: List[MetricWriter] = []
        self.global_steps_finished = 0
        self.epochs_finished = 0
        self.batches_finished_in_epoch = 0
        self.should_stop = False
        self.optimizers: List[torch.optim.Optimizer] = []
        self.schedulers: List[Any] = []
        self._train_loader: Optional[DataLoader] = None
        self._loader_length: Optional[int] = None
        self._runner = StepRunner(module)
        self._wrapped: Optional[torch.nn.Module] = None
        self._metrics = MetricCollector()
        module.__dict__["_metric_logger"] = self._metrics
        self._running_loss: Optional[torch.Tensor] = None
        self._running_count = 0
        self._unsummed_losses: List[torch.Tensor] = []
        self._hooks: Dict[str, List[Any]] = {}
        self._logged_loss: Optional[torch.Tensor] = None
        self._logged_count = 0
        self._pending_rng: Optional[Dict[str, Any]] = None
        self._restored = False
        self._closure_optimizers = False
        self._last_validation_step: Optional[int] = None
        self._time_is_up = False
        self._start_time = 0.0
        seed_everything(args.seed)
        module.to(self.device)

    # -- properties ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the module and batches live."""
        return self.backend.device

    @property
    def is_main_process(self) -> bool:
        """True on rank zero: the rank that prints and writes files."""
        return self.backend.is_main_process

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
        """Train for ``args.epochs`` (or until ``max_steps``, ``max_time`` or a stop request)."""
        try:
            self._setup_training()
            self._call_hook("on_begin_train", self.global_steps_finished)
            if self.args.sanity_val_steps and self.global_steps_finished == 0:
                self._evaluate(Stage.VAL, max_batches=self.args.sanity_val_steps, record=False)
            save_final = True
            try:
                while self.epochs_finished < self.args.epochs and not self._should_end_training():
                    self._train_epoch()
                    self._end_epoch()
            except StopTraining as stop:
                logger.info("training stopped: %s", stop)
                save_final = getattr(stop, "save_checkpoint", True)
            self._call_hook("on_end_train", self.global_steps_finished)
            if save_final and self.checkpointer_enabled and self.checkpointer.saves_at_end():
                self.save_checkpoint()
            self.checkpointer.wait()
        except BaseException:
            self.close()
            raise
        finally:
            self._close_writers()
        return self.history

    def _train_epoch(self) -> None:
        """One epoch: micro-batches, accumulation cycles, optimizer steps."""
        args, accumulation = self.args, self.gradient_accumulation
        micro_batches = self._micro_batches_this_epoch()
        self._train_sampler_call("set_epoch", self.epochs_finished)
        self._train_sampler_call("fast_forward", self.batches_finished_in_epoch * self.train_step_batch_size)
        # Creating a DataLoader iterator draws a seed from the global RNG. A resumed run
        # restores the saved RNG where the saved run was: before that draw at an epoch
        # boundary, after it mid-epoch.
        if self.batches_finished_in_epoch == 0:
            self._restore_pending_rng()
            self._running_loss = torch.zeros((), device=self.device)
            self._running_count = 0
            self._logged_loss, self._logged_count = self._running_loss.clone(), 0
        batches = iter(self._train_loader)
        self._restore_pending_rng()
        self._call_hook("on_begin_train_epoch", self.global_steps_finished, self.epochs_finished)
        kept_outputs: List[Tuple[Any, ...]] = []
        wrapped = self._wrapped
        for batch_index in range(self.batches_finished_in_epoch, micro_batches or 2**62):
            batch = next(batches, None)
            if micro_batches is None and self.backend.world_size > 1:
                # A loader without a length may run out on one rank first: all stop together,
                # or the others would wait in a gradient all-reduce it never joins.
                has_batch = torch.tensor(float(batch is not None), device=self.device)
                if not self.backend.all_reduce(has_batch, "min").item():
                    break
            if batch is None:
                break
            batch = self.backend.move_to_device(batch)
            cycle_start = batch_index - batch_index % accumulation
            cycle_length = min(accumulation, micro_batches - cycle_start) if micro_batches else accumulation
            ends_cycle = batch_index + 1 == cycle_start + cycle_length
            if self._closure_optimizers:
                outputs = self._closure_optimizer_step(wrapped, batch)
            else:
                skip_sync = not ends_cycle and micro_batches is not None
                outputs = self._forward_backward(wrapped, batch, cycle_length, skip_sync)
            loss = outputs[0]
            self._unsummed_losses.append(loss.detach())  # summed on the device when read
            self._running_count += 1
            if len(self._unsummed_losses) >= 1024:
                self._sum_losses()
            if args.collect_train_outputs:
                kept_outputs.append(map_tensors(outputs, torch.Tensor.detach))
            self._call_hook("on_end_train_step", self.global_steps_finished, *outputs)
            if ends_cycle:
                self.batches_finished_in_epoch = batch_index + 1
                if not self._closure_optimizers:
                    self._optimizer_step()
                if self._after_optimizer_step():
                    break
        if micro_batches is None and self._has_pending_gradients():
            self._optimizer_step()
            self._after_optimizer_step()
        self._end_train_epoch(kept_outputs)

    def _forward_backward(self, wrapped: torch.nn.Module, batch: Any, cycle_length: int, skip_sync: bool) -> Tuple[Any, ...]:
        """Forward and backward of one micro-batch; with ``tbptt_steps``, chunk by chunk along
        dim 1, carrying the (detached) hidden state and summing the chunks' gradients."""
        step, device = self.global_steps_finished, self.device
        if not self.args.tbptt_steps:
            with self.backend.no_sync(wrapped, skip_gradient_sync=skip_sync):
                outputs = as_outputs(self.backend.forward(wrapped, Stage.TRAIN, step, batch, device), "train_step")
                self.backend.backward(outputs[0] / cycle_length if cycle_length > 1 else outputs[0])
            self._call_hook("on_end_backward", step, outputs[0])
            return outputs
        chunks = split_along_time(batch, self.args.tbptt_steps)
        hiddens, total_loss = None, 0.0
        for index, chunk in enumerate(chunks):
            with self.backend.no_sync(wrapped, skip_gradient_sync=skip_sync or index + 1 < len(chunks)):
                outputs = as_outputs(self.backend.forward(wrapped, Stage.TRAIN, step, chunk, device, hiddens), "train_step")
                if len(outputs) < 2:
                    raise TypeError("with tbptt_steps set, train_step(global_step, batch, device, hiddens) must return (loss, hiddens, ...)")
                self.backend.backward(outputs[0] / (cycle_length * len(chunks)))
            self._call_hook("on_end_backward", step, outputs[0])
            hiddens = map_tensors(outputs[1], torch.Tensor.detach)
            total_loss = total_loss + outputs[0].detach()
        return (total_loss / len(chunks), *outputs[1:])

    def _closure_optimizer_step(self, wrapped: torch.nn.Module, batch: Any) -> Tuple[Any, ...]:
        """One step of optimizers that re-evaluate the loss themselves (LBFGS)."""
        first_outputs: List[Tuple[Any, ...]] = []

        def closure() -> torch.Tensor:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=False)
            outputs = as_outputs(self.backend.forward(wrapped, Stage.TRAIN, self.global_steps_finished, batch, self.device), "train_step")
            self.backend.backward(outputs[0])
            self._clip_gradients()
            if not first_outputs:
                first_outputs.append(outputs)
                self._call_hook("on_end_backward", self.global_steps_finished, outputs[0])
            return outputs[0]

        self._optimizer_step(closure)
        return first_outputs[0]

    def _clip_gradients(self) -> None:
        args = self.args
        if args.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(self._parameters, args.clip_grad_value)
        if args.clip_grads or args.track_grad_norm:
            max_norm = args.max_grad_norm if args.clip_grads else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters, max_norm)
            if args.track_grad_norm:
                self._metrics.log("grad_norm", grad_norm, on_step=True, on_epoch=True)

    def _optimizer_step(self, closure: Any = None) -> None:
        """Unscale, clip, step optimizers (and per-step schedulers), zero gradients."""
        args = self.args
        if closure is None:
            self.backend.unscale_gradients(self.optimizers)
            self._clip_gradients()
        stepped = self.backend.step_optimizers(self.optimizers, closure)
        if stepped and args.scheduler_interval == "step":
            self._step_schedulers()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.global_steps_finished += 1

    def _after_optimizer_step(self) -> bool:
        """Hooks, logging, mid-epoch validation and saves after a step; True ends the epoch."""
        args, step = self.args, self.global_steps_finished
        self._call_hook("on_end_optimizer_step", step)
        if args.max_time is not None and time.monotonic() - self._start_time > args.max_time:
            self._time_is_up = True
        at_log_point = step % args.log_every_n_steps == 0
        if at_log_point:
            self._log_train_metrics()
        if args.val_every_n_steps and step % args.val_every_n_steps == 0:
            self._evaluate(Stage.VAL)
        if self.checkpointer_enabled and self.checkpointer.is_step_save_due(step):
            self.save_checkpoint()
        if self.backend.world_size > 1 and not at_log_point:
            # Ranks agree on stopping only where they synchronise anyway (log points, epoch ends).
            return args.max_steps is not None and step >= args.max_steps
        return self._should_end_training()

    def _step_schedulers(self) -> None:
        """Step every scheduler but ReduceLROnPlateau (which follows validation)."""
        for scheduler in self.schedulers:
            if not isinstance(scheduler, _PLATEAU):
                scheduler.step()

    def _agree_on_stopping(self) -> None:
        """Under several ranks, stop if any rank wants to (one tiny all-reduce)."""
        if self.backend.world_size > 1:
            flags = torch.tensor([float(self.should_stop), float(self._time_is_up)], device=self.device)
            flags = self.backend.all_reduce(flags, "max").tolist()
            self.should_stop, self._time_is_up = bool(flags[0]), bool(flags[1])

    def _sum_losses(self) -> None:
        """Fold the losses kept since the last read into the running sum (one device op)."""
        if self._unsummed_losses:
            self._running_loss += torch.stack([loss.float().reshape(()) for loss in self._unsummed_losses]).sum()
            self._unsummed_losses.clear()

    def _end_train_epoch(self, kept_outputs: List[Tuple[Any, ...]]) -> None:
        self._sum_losses()
        if self._running_count:
            mean_loss = self.backend.all_reduce(self._running_loss / self._running_count)
            self._record({"train_loss_epoch": float(mean_loss)})
        outputs = concatenate_outputs(kept_outputs)
        self._call_hook("on_end_train_epoch", self.global_steps_finished, *outputs)
        self._record(self._reduce_collected(self._metrics.pop_epoch()))  # from steps and the hook above

    def _end_epoch(self) -> None:
        """Counters, epoch schedulers, validation and the epoch-end checkpoint."""
        epoch_completed = self.batches_finished_in_epoch >= (self._micro_batches_this_epoch() or 0)
        if not epoch_completed and self._should_end_training():
            return  # stopped mid-epoch: the final checkpoint records the position
        if self.args.scheduler_interval == "epoch":
            self._step_schedulers()
        every = self.args.val_every_n_epochs
        if every and (self.epochs_finished + 1) % every == 0 and self._last_validation_step != self.global_steps_finished:
            self._evaluate(Stage.VAL)
        self._log_epoch_summary()
        self.epochs_finished += 1
        self.batches_finished_in_epoch = 0
        self._agree_on_stopping()
        training_ends = self.epochs_finished >= self.args.epochs or self._should_end_training()
        if self.checkpointer_enabled and not (training_ends and self.checkpointer.saves_at_end()):
            self.save_checkpoint(index=self.epochs_finished, force=False)  # the final save covers the last epoch

    def _log_epoch_summary(self) -> None:
        epoch = self.epochs_finished
        latest = {r["name"]: r["value"] for r in self.history.records if r["epoch"] == epoch and r["name"] != "train_loss"}
        summary = "  ".join(f"{name}={value:.4g}" for name, value in latest.items())
        logger.info("epoch %d/%d (step %d): %s", epoch + 1, self.args.epochs, self.global_steps_finished, summary)

    def _should_end_training(self) -> bool:
        args = self.args
        if args.max_steps is not None and self.global_steps_finished >= args.max_steps:
            return True
        if self._time_is_up:
            return True
        return self.should_stop and self.epochs_finished >= args.min_epochs

    # -- evaluation ---------------------------------------------------------------------
    def validate(self) -> Dict[str, float]:
        """Run the validation loaders once; return the recorded metrics."""
        return self._standalone_evaluation(Stage.VAL)

    def test(self) -> Dict[str, float]:
        """Run the test loaders once; return the recorded metrics."""
        return self._standalone_evaluation(Stage.TEST)

    def _standalone_evaluation(self, stage: Stage) -> Dict[str, float]:
        self._prepare_callbacks()
        self._start_writers()
        try:
            return self._evaluate(stage)
        finally:
            self._close_writers()

    def _evaluate(self, stage: Stage, max_batches: Optional[int] = None, record: bool = True) -> Dict[str, float]:
        """Run every loader of ``stage`` without gradients; gather outputs in dataset order."""
        args = self.args
        batch_size = args.val_batch_size or self.train_step_batch_size
        sampler = self.backend.sampler_factory(shuffle=False, seed=args.seed)
        get_loaders = self.module.get_val_dataloaders if stage is Stage.VAL else self.module.get_test_dataloaders
        loaders = as_loader_dict(get_loaders(sampler, batch_size), get_loaders.__name__)
        results: Dict[str, float] = {}
        was_training = self.module.training
        train_metrics, eval_metrics = self._metrics, MetricCollector()
        self.module.__dict__["_metric_logger"] = eval_metrics
        self.module.eval()
        try:
            for key, loader in loaders.items():
                if record:
                    self._call_hook(f"on_begin_{stage.value}_epoch", self.global_steps_finished, key=key)
                limit = max_batches or _batch_limit(args.max_val_steps_per_epoch, loader)
                collected = []
                with torch.no_grad():
                    for index, batch in enumerate(loader):
                        if limit is not None and index >= limit:
                            break
                        batch = self.backend.move_to_device(batch)
                        step_outputs = self.backend.forward(self._runner, stage, self.global_steps_finished, batch, self.device)
                        collected.append(as_outputs(step_outputs, f"{stage.value}_step"))
                if not record:
                    continue
                outputs = self._gather_in_dataset_order(collected)
                suffix = f"/{key}" if key else ""
                metrics = {f"{stage.value}_loss{suffix}": float(outputs[0].float().mean())} if outputs else {}
                self._call_hook(f"on_end_{stage.value}_epoch", self.global_steps_finished, *outputs, key=key)
                logged = self._reduce_collected(eval_metrics.pop_epoch())  # from steps and the hook above
                metrics.update({f"{name}{suffix}": value for name, value in logged.items()})
                self._record(metrics)
                results.update(metrics)
        finally:
            self.module.train(was_training)
            self.module.__dict__["_metric_logger"] = train_metrics
        if record and stage is Stage.VAL:
            self._last_validation_step = self.global_steps_finished
            self._step_plateau_schedulers()
        return results

    def _gather_in_dataset_order(self, collected: List[Tuple[Any, ...]]) -> Tuple[Any, ...]:
        """This rank's step outputs joined, then every rank's interleaved back into dataset order."""
        local = concatenate_outputs(collected)
        if self.backend.world_size == 1:
            return local
        return interleave_ranks(self.backend.all_gather_object(map_tensors(local, torch.Tensor.cpu)))

    def _step_plateau_schedulers(self) -> None:
        plateau = [s for s in self.schedulers if isinstance(s, _PLATEAU)]
        value = self.history.latest(self.args.scheduler_monitor)
        if plateau and value is None:
            raise ValueError(
                f"ReduceLROnPlateau needs the metric scheduler_monitor={self.args.scheduler_monitor!r}, "
                f"which was not recorded; recorded metrics: {self.history.names()}"
            )
        for scheduler in plateau:
            scheduler.step(value)

    # -- metrics --------------------------------------------------------------------------
    def _log_train_metrics(self) -> None:
        """Read the loss since the last log point (and logged step values) back from the device,
        with the ranks' stop requests riding on the same all-reduce, and write them."""
        self._sum_losses()
        count = self._running_count - self._logged_count
        interval_mean = (self._running_loss - self._logged_loss) / max(count, 1)
        flags = torch.tensor([float(self.should_stop), float(self._time_is_up)], device=self.device)
        loss, stop, time_is_up = self.backend.all_reduce(torch.cat([interval_mean.float().reshape(1), flags])).tolist()
        self.should_stop, self._time_is_up = stop > 0, time_is_up > 0  # any rank asked
        self._logged_loss, self._logged_count = self._running_loss.clone(), self._running_count
        metrics = {"train_loss": loss} if count else {}
        metrics.update(self._reduce_collected(self._metrics.pop_step()))
        self._record(metrics)

    def _reduce_collected(self, collected: Dict[str, Tuple[torch.Tensor, str]]) -> Dict[str, float]:
        return reduce_metrics(collected, self.backend.all_reduce, self.device)

    def log_metrics(self, metrics: Dict[str, float]) -> None:
        """Record host-side values now (history, writers on rank zero, ``on_log_metrics`` hooks).

        For callbacks (``LearningRateMonitor``, ``Timer``); call it on every rank with the
        same names. Not from ``on_log_metrics`` itself, which it calls.
        """
        self._record({name: float(value) for name, value in metrics.items()})

    def _record(self, metrics: Dict[str, float]) -> None:
        if not metrics:
            return
        records = [self.history.add(name, value, self.global_steps_finished, self.epochs_finished) for name, value in metrics.items()]
        if self.is_main_process:
            for writer in self.writers:
                writer.write(records)
        self._call_hook("on_log_metrics", self.global_steps_finished, dict(metrics))

    def _close_writers(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []  # a later validate()/test() starts them again from the history

    def _start_writers(self) -> None:
        if self.writers or not self.is_main_process or self.args.fast_dev_run:
            return
        self.writers.append(CSVWriter(os.path.join(self.args.output_dir, "metrics.csv")))
        if self.args.tensorboard:
            self.writers.append(TensorBoardWriter(os.path.join(self.args.output_dir, "tensorboard")))
        for writer in self.writers:
            writer.start(self.history.records)

    # -- setup ----------------------------------------------------------------------------
    def _create_train_loader(self) -> None:
        if self._train_loader is not None:
            return
        sampler = self.backend.sampler_factory(shuffle=True, seed=self.args.seed)
        self._train_loader = self.module.get_train_dataloader(sampler, self.train_step_batch_size)
        try:
            length = len(self._train_loader)
        except TypeError:
            length = None
        if length is not None and self.backend.world_size > 1:
            length = int(self.backend.all_reduce(torch.tensor(length, device=self.device), "min"))
        self._loader_length = length

    def _setup_training(self) -> None:
        self._create_train_loader()
        if self._wrapped is None:
            self._wrapped = self.backend.wrap_module(self._runner)
            self._parameters = [p for p in self.module.parameters() if p.requires_grad]
        if not self.optimizers:
            optimizers, schedulers = self.module.get_optimizers_schedulers(
                self.estimated_global_steps_per_epoch, self.args.epochs
            )
            self.optimizers, self.schedulers = list(optimizers), list(schedulers or [])
            if not self.optimizers:
                raise ValueError("get_optimizers_schedulers returned no optimizer; return ([optimizer, ...], [schedulers])")
            self._closure_optimizers = any(isinstance(o, torch.optim.LBFGS) for o in self.optimizers)
            if self._closure_optimizers and (self.gradient_accumulation > 1 or self.args.tbptt_steps):
                raise ValueError(
                    "LBFGS re-evaluates the loss itself: it needs gradient_accumulation == 1 (gpu_batch_size_limit "
                    f"unset or >= the per-process batch, got accumulation {self.gradient_accumulation}) and no tbptt_steps"
                )
        self._prepare_callbacks()
        if not self._restored:
            self._restored = True
            self._restore_checkpoint()
        self._start_writers()
        if self.is_main_process and not self.args.fast_dev_run:
            resolved_config(self.args).save(os.path.join(self.args.output_dir, "config.yaml"))
        self._start_time = time.monotonic()
        self.module.train()

    def _micro_batches_this_epoch(self) -> Optional[int]:
        steps = self.estimated_global_steps_per_epoch
        if steps is None:
            return None
        if self._loader_length is None:
            return steps * self.gradient_accumulation
        return min(self._loader_length, steps * self.gradient_accumulation)

    def _train_sampler_call(self, method: str, *arguments: Any) -> None:
        sampler = getattr(self._train_loader, "sampler", None)
        if hasattr(sampler, method):
            getattr(sampler, method)(*arguments)
        elif method == "fast_forward" and arguments[0]:
            raise ValueError(
                f"resuming mid-epoch needs the train loader's sampler to support fast_forward(n), and "
                f"{type(sampler).__name__} does not; build it with the sampler(dataset) callable handed to "
                "get_train_dataloader"
            )

    def _restore_pending_rng(self) -> None:
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None

    def _has_pending_gradients(self) -> bool:
        return any(p.grad is not None for p in self._parameters)

    # -- hooks ----------------------------------------------------------------------------
    def _prepare_callbacks(self) -> None:
        """Hand each callback the trainer; look hooks up afresh (callbacks may have changed)."""
        for callback in self.callbacks:
            callback.setup(self)
        self._hooks = {}

    def _call_hook(self, name: str, *arguments: Any, **keywords: Any) -> None:
        """The module's hook, then each callback's (only those that override it)."""
        hooks = self._hooks.get(name)
        if hooks is None:
            targets = (self.module, *self.callbacks)
            hooks = self._hooks[name] = [getattr(target, name) for target in targets if _overrides(target, name)]
        for hook in hooks:
            hook(*arguments, **keywords)

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def checkpointer_enabled(self) -> bool:
        return not self.args.fast_dev_run

    def save_checkpoint(self, index: Optional[int] = None, force: bool = True) -> Optional[str]:
        """Save module, trainer and backend state now (or, with ``force=False``, if ``index`` is due).

        Call it on every rank, at an optimizer-step boundary (e.g. from ``on_end_optimizer_step``)
        for an exact resume. Every rank builds the state (RNG states are gathered); after a
        barrier rank zero writes, and its result (where it went, or its error) is broadcast,
        so every rank waits for the save and every rank raises if it failed.
        Returns where the checkpoint went, or None when it was not due.
        """
        trainer_state = self.get_state()  # collective under DDP: every rank builds it
        step = self.global_steps_finished
        checkpoint = Checkpoint(
            module_state=self.module.get_state(),
            trainer_state=trainer_state,
            backend_state=self.backend.get_state(),
            global_step=step,
            epoch=self.epochs_finished,
            # Only values measured on these weights rank the checkpoint (best-k retention).
            metrics={record["name"]: record["value"] for record in self.history.records if record["step"] == step},
        )
        self.backend.barrier()
        location, error = None, None
        if self.is_main_process:
            try:
                location = self.checkpointer.save(checkpoint, self.epochs_finished if index is None else index, force=force)
            except Exception as caught:  # re-raised below, after the other ranks learn about it
                error = caught
        if self.backend.world_size > 1:  # the broadcast is the barrier after the save
            failure = None if error is None else f"{type(error).__name__}: {error}"
            location, failure = self.backend.broadcast_object((location, failure))
            if error is None and failure is not None:
                raise RuntimeError(f"rank zero failed to save a checkpoint: {failure}")
        if error is not None:
            raise error
        return location

    def save_model_checkpoint(self) -> Optional[str]:
        """Write the module's weights alone (for inference), on rank zero."""
        location = None
        if self.is_main_process:
            location = self.checkpointer.save_model(self.module.get_state(), self.global_steps_finished)
        self.backend.barrier()
        return location

    def _restore_checkpoint(self) -> None:
        checkpoint = self.checkpointer.load()
        if self.backend.world_size > 1:
            steps = self.backend.all_gather_object(None if checkpoint is None else checkpoint.global_step)
            if len(set(steps)) > 1:
                raise RuntimeError(
                    f"the ranks loaded different checkpoints (global step per rank: {steps}); every rank must "
                    f"see the same checkpoint directory: use a shared filesystem or URL for save_dir/load_dir"
                )
        if checkpoint is None:
            return
        self.module.update_state(checkpoint.module_state)
        if self.checkpointer.restores_model_only():  # reset_optimizers_schedulers: weights only
            return
        self.backend.update_state(checkpoint.backend_state)
        self.update_state(checkpoint.trainer_state)

    def get_state(self) -> Dict[str, Any]:
        """Counters and the position in the epoch (the sampler is fast-forwarded to it), optimizers,
        schedulers, callbacks, history, and per rank: RNG states, running losses, logged values.
        Collective under DDP (the per-rank part is gathered): call it on every rank."""
        self._sum_losses()
        running_loss = self._running_loss if self._running_loss is not None else torch.zeros(())
        rank_local = {  # differs between ranks: gathered, each rank restores its own
            "rng": capture_rng_state(),
            "running_loss": running_loss.detach().cpu(),
            "running_count": self._running_count,
            "logged_loss": (self._logged_loss if self._logged_loss is not None else running_loss).detach().cpu(),
            "logged_count": self._logged_count,
            "logged_values": self._metrics.state_dict(),
        }
        return {
            "epochs_finished": self.epochs_finished,
            "global_steps_finished": self.global_steps_finished,
            "batches_finished_in_epoch": self.batches_finished_in_epoch,
            "micro_batch_size": self.train_step_batch_size,
            "should_stop": self.should_stop,
            "ranks": self.backend.all_gather_object(rank_local),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
            "callbacks": [{"type": type(callback).__name__, "state": callback.get_state()} for callback in self.callbacks],
            "checkpointer": self.checkpointer.get_state(),
            "history": self.history.state_dict(),
            "world_size": self.backend.world_size,
        }

    def update_state(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`get_state` returned (optimizers must exist: call inside train)."""
        self.epochs_finished = int(state["epochs_finished"])
        self.global_steps_finished = int(state["global_steps_finished"])
        self.batches_finished_in_epoch = self._resume_position(state)
        ranks = state["ranks"]
        if len(ranks) != self.backend.world_size:
            logger.warning(
                "checkpoint written by %d ranks, resumed on %d: RNG streams and running losses are taken from "
                "rank (this rank mod %d)", len(ranks), self.backend.world_size, len(ranks),
            )
        mine = ranks[self.backend.rank % len(ranks)]
        self._running_loss = mine["running_loss"].to(self.device)
        self._running_count = int(mine["running_count"])
        self._logged_loss = mine["logged_loss"].to(self.device)
        self._logged_count = int(mine["logged_count"])
        self._metrics.load_state_dict(mine["logged_values"], self.device)
        self._pending_rng = mine["rng"]  # restored around the train loader's iterator (see _train_epoch)
        self.should_stop = bool(state["should_stop"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
        saved_callbacks = list(state["callbacks"])
        for callback in self.callbacks:  # matched by class name, in order
            match = next((entry for entry in saved_callbacks if entry["type"] == type(callback).__name__), None)
            if match is not None:
                saved_callbacks.remove(match)
                callback.update_state(match["state"])
        self.checkpointer.update_state(state.get("checkpointer", {}))
        self.history.load_state_dict(state["history"])

    def _resume_position(self, state: Dict[str, Any]) -> int:
        """Micro-batches of the current epoch this rank has finished, per the checkpoint.

        A checkpoint taken with another world size or micro-batch size is mapped through
        the number of samples the whole job had consumed in the epoch.
        """
        batches = int(state["batches_finished_in_epoch"])
        world_size, micro_batch = self.backend.world_size, self.train_step_batch_size
        saved_world_size = int(state.get("world_size", world_size))
        saved_micro_batch = int(state.get("micro_batch_size", micro_batch))
        if not batches or (saved_world_size, saved_micro_batch) == (world_size, micro_batch):
            return batches
        samples = batches * saved_micro_batch * saved_world_size
        if samples % (micro_batch * world_size * self.gradient_accumulation):
            logger.warning(
                "checkpoint taken after %d samples of the epoch (%d ranks x %d per micro-batch); resuming with %d ranks x %d "
                "x %d accumulated micro-batches does not land on an optimizer step: it resumes from the step before "
                "(those samples are seen twice)", samples, saved_world_size, saved_micro_batch, world_size, micro_batch, self.gradient_accumulation,
            )
        batches = samples // (micro_batch * world_size)
        return batches - batches % self.gradient_accumulation

    def close(self) -> None:
        """Wait for background saves and leave the process group."""
        try:
            self.checkpointer.wait()
        finally:
            self.backend.teardown()


def _batch_limit(limit: Optional[float], loader: Iterable) -> Optional[int]:
    if limit is None or isinstance(limit, int):
        return limit
    return max(1, math.floor(limit * len(loader)))


def _overrides(target: Any, hook: str) -> bool:
    """True when ``target`` implements ``hook`` beyond TrainingHooks' no-op (only those are called)."""
    if hook in getattr(target, "__dict__", {}):
        return True
    implementation = getattr(type(target), hook, None)
    return implementation is not None and implementation is not getattr(TrainingHooks, hook)
