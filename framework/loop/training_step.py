"""One optimizer step: the path of a batch from the loader to the optimizer, in one place.

For each micro-batch of the step: the next batch (on the device), forward and backward (all
but the last under ``no_sync``; chunk by chunk along time with ``tbptt_steps``), the loss kept
on the device. Then unscale, clip, step the optimizers and the per-step schedulers, and zero
the gradients. Manual optimization runs ``train_step`` alone; LBFGS-like optimizers get a
closure that re-evaluates the loss.
"""

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from backends import TrainerBackend, map_tensors
from framework.loop.gradient_accumulators import gradient_accumulators
from framework.loop.hooks import HookDispatcher
from framework.loop.schedulers import LRSchedules
from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.tbptt import split_along_time
from framework.loop.training_state import TrainingProgress
from framework.metrics.collector import MetricCollector
from framework.metrics.loss_tracker import LossTracker
from framework.module import ModuleInterface
from framework.run import checks
from framework.run.arguments import TrainerArguments


class TrainingStep:
    """Runs optimizer steps for the trainer once :meth:`prepare` has handed it the wrapped module
    and the optimizers.

    Args:
        module: the user's module (its first loss is checked for a graph).
        args: the run's arguments (clipping, TBPTT, kept outputs).
        backend: moves batches, runs backward, steps optimizers.
        hooks: ``on_end_backward`` and ``on_end_train_step`` go through it.
        progress: the step counter hooks receive.
        losses: where each micro-batch's loss is kept, on the device.
        collector: where ``track_grad_norm`` logs the gradient norm.

    Example:
        step = TrainingStep(module, args, backend, hooks, progress, losses, collector)
        step.prepare(forward, wrapped, optimizers, schedules, automatic=True, loader_length=len(loader))
        micro_batches = step.run(iter(loader), cycle_length=4)
    """

    def __init__(
        self,
        module: ModuleInterface,
        args: TrainerArguments,
        backend: TrainerBackend,
        hooks: HookDispatcher,
        progress: TrainingProgress,
        losses: LossTracker,
        collector: MetricCollector,
    ) -> None:
        self.module, self.args, self.backend, self.hooks = module, args, backend, hooks
        self.progress, self.losses, self.collector = progress, losses, collector
        self.kept_outputs: List[Tuple[Any, ...]] = []  # with collect_train_outputs, until the epoch ends
        self.explain_schedule_error: Callable[[ValueError], None] = lambda error: None
        self._forward: Any = None
        self._device = backend.device
        self._wrapped: torch.nn.Module = module
        self._parameters: List[torch.nn.Parameter] = []
        self._gradient_accumulators: List[Any] = []  # kept alive: not rebuilt every step
        self._optimizers: Sequence[torch.optim.Optimizer] = ()
        self._schedules = LRSchedules()
        self._automatic = True
        self._closure = False  # LBFGS-like optimizers re-evaluate the loss themselves
        # The backend's calls the loop makes itself where they are plain (``is_plain``), decided in prepare():
        self._no_sync: Optional[Callable[..., Any]] = backend.no_sync
        self._backward: Callable[[torch.Tensor], None] = backend.backward
        self._unscale_gradients: Optional[Callable[..., None]] = backend.unscale_gradients
        self._step_optimizers: Callable[..., bool] = backend.step_optimizers
        self._sync_every_batch = False  # a stream: its last micro-batch is not known ahead
        self._first_loss_checked = False

    def prepare(
        self,
        forward: Any,
        wrapped: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedules: LRSchedules,
        automatic: bool,
        loader_length: Optional[int],
    ) -> None:
        """Hand over what steps run on (again after the train loader changed)."""
        self._forward, self._wrapped, self._optimizers, self._schedules = forward, wrapped, optimizers, schedules
        self._parameters = [p for p in self.module.parameters() if p.requires_grad]
        self._gradient_accumulators = gradient_accumulators(self._parameters)
        self._automatic = automatic
        self._closure = any(isinstance(optimizer, torch.optim.LBFGS) for optimizer in optimizers)
        self._sync_every_batch = loader_length is None
        backend, plain = self.backend, self.backend.is_plain
        self._no_sync = None if plain("no_sync") else backend.no_sync
        self._backward = torch.Tensor.backward if plain("backward") else backend.backward
        self._unscale_gradients = None if plain("unscale_gradients") else backend.unscale_gradients
        self._step_optimizers = backend.precision.step_optimizers if plain("step_optimizers") else backend.step_optimizers

    @property
    def uses_closure(self) -> bool:
        """True when an optimizer re-evaluates the loss itself (LBFGS)."""
        return self._closure

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """Forward and backward of up to ``cycle_length`` micro-batches, then one optimizer
        step; returns how many micro-batches there were (0: the stream had ended)."""
        if not self._automatic or self._closure:
            batch = self._next_batch(batches)
            if batch is None:
                return 0
            if self._automatic:
                self._after_micro_batch(self._closure_step(batch))
            else:  # manual optimization: train_step steps the optimizers itself
                step = self.progress.global_steps_finished
                self._after_micro_batch(as_outputs(self._forward(Stage.TRAIN, step, batch, self._device), "train_step"))
            return 1
        seen = 0
        for index in range(cycle_length):
            batch = self._next_batch(batches)
            if batch is None:
                break
            sync = self._sync_every_batch or index + 1 == cycle_length
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
        if self._sync_every_batch and not self.backend.all_ranks_have_batch(batch is not None):
            return None  # every rank stops when the first runs out (the others would wait in an all-reduce)
        return None if batch is None else self.backend.move_to_device(batch)

    def _forward_backward(self, batch: Any, cycle_length: int, sync: bool) -> Tuple[Any, ...]:
        """Forward and backward of one micro-batch; with ``tbptt_steps``, chunk by chunk along
        dim 1, carrying the (detached) hidden state and summing the chunks' gradients."""
        step = self.progress.global_steps_finished
        if not self.args.tbptt_steps:
            if self._no_sync is None:
                outputs = self._forward_then_backward(step, batch, cycle_length)
            else:
                with self._no_sync(self._wrapped, skip_gradient_sync=not sync):
                    outputs = self._forward_then_backward(step, batch, cycle_length)
            self.hooks.call("on_end_backward", step, outputs[0])
            return outputs
        chunks = split_along_time(batch, self.args.tbptt_steps)
        hiddens, total_loss = None, 0.0
        for index, chunk in enumerate(chunks):
            with self.backend.no_sync(self._wrapped, skip_gradient_sync=not sync or index + 1 < len(chunks)):
                outputs = as_outputs(self._forward(Stage.TRAIN, step, chunk, self._device, hiddens), "train_step")
                if len(outputs) < 2:
                    raise TypeError(
                        "with tbptt_steps set, train_step(global_step, batch, device, hiddens) must return (loss, hiddens, ...)"
                    )
                if not self._first_loss_checked:
                    self._check_first_loss(outputs[0])
                self._backward(outputs[0] / (cycle_length * len(chunks)))
            self.hooks.call("on_end_backward", step, outputs[0])
            hiddens = map_tensors(outputs[1], torch.Tensor.detach)
            total_loss = total_loss + outputs[0].detach()
        return (total_loss / len(chunks), *outputs[1:])

    def _forward_then_backward(self, step: int, batch: Any, cycle_length: int) -> Tuple[Any, ...]:
        outputs = as_outputs(self._forward(Stage.TRAIN, step, batch, self._device), "train_step")
        if not self._first_loss_checked:
            self._check_first_loss(outputs[0])
        self._backward(outputs[0] / cycle_length if cycle_length > 1 else outputs[0])
        return outputs

    def _check_first_loss(self, loss: torch.Tensor) -> None:
        checks.check_loss_requires_grad(loss, self.module)
        self._first_loss_checked = True

    def _after_micro_batch(self, outputs: Tuple[Any, ...]) -> None:
        """Keep the loss on the device (and the outputs when asked); ``on_end_train_step``."""
        step = self.progress.global_steps_finished
        self.losses.add(outputs[0], step)
        if self.args.collect_train_outputs:
            self.kept_outputs.append(map_tensors(outputs, torch.Tensor.detach))
        self.hooks.call("on_end_train_step", step, *outputs)

    def _closure_step(self, batch: Any) -> Tuple[Any, ...]:
        """One step of optimizers that re-evaluate the loss themselves (LBFGS)."""
        first_outputs: List[Tuple[Any, ...]] = []
        step = self.progress.global_steps_finished

        def closure() -> torch.Tensor:
            for optimizer in self._optimizers:
                optimizer.zero_grad(set_to_none=False)
            outputs = as_outputs(self._forward(Stage.TRAIN, step, batch, self._device), "train_step")
            if not self._first_loss_checked:
                self._check_first_loss(outputs[0])
            self.backend.backward(outputs[0])
            self.clip_gradients()
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
            if self._unscale_gradients is not None:
                self._unscale_gradients(self._optimizers)
            if args.clip_grads or args.track_grad_norm or args.clip_grad_value is not None:
                self.clip_gradients()
        stepped = self._step_optimizers(self._optimizers, closure)
        if stepped and self._schedules.scheduled:
            try:
                self._schedules.step_per_optimizer_step(self.progress.global_steps_finished + 1)
            except ValueError as error:
                self.explain_schedule_error(error)  # OneCycleLR past total_steps: an extended resumed run
                raise
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> None:
        """Clip by value and/or norm as the arguments ask; log the norm with ``track_grad_norm``."""
        args = self.args
        max_norm = None
        if args.clip_grads or args.track_grad_norm:
            max_norm = args.max_grad_norm if args.clip_grads else float("inf")
        grad_norm = self.backend.clip_gradients(self._parameters, max_norm, args.clip_grad_value)  # whatever the meshes
        if grad_norm is not None and args.track_grad_norm:
            self.collector.log("grad_norm", grad_norm, on_step=True, on_epoch=True)
