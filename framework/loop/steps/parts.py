"""What every step mode shares: the trainer's parts a step uses, and the pieces each mode calls.

The backend's calls that are plain (``TrainerBackend.is_plain``) are made directly, decided in
:meth:`StepParts.bind`, so a step makes ``loss.backward()`` and ``optimizer.step()`` itself where
nothing overrides them.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from backends import TrainerBackend, map_tensors
from framework.config.arguments import TrainerArguments
from framework.loop import module_checks as checks
from framework.loop.gradient_accumulators import gradient_accumulators
from framework.loop.hooks import HookDispatcher
from framework.loop.schedulers import LRSchedules
from framework.loop.training_state import TrainingProgress
from framework.metrics.collector import MetricCollector
from framework.metrics.loss_tracker import LossTracker
from framework.module import ModuleInterface


class StepParts:
    """The trainer's parts a step uses and the pieces every step mode calls.

    Args:
        module: the user's module (its first loss is checked for a graph).
        args: the run's arguments (clipping, TBPTT, kept outputs).
        backend: moves batches, runs backward, steps optimizers.
        hooks: ``on_end_backward`` and ``on_end_train_step`` go through it.
        progress: the step counter hooks receive.
        losses: where each micro-batch's loss is kept, on the device.
        collector: where ``track_grad_norm`` logs the gradient norm.

    Example:
        parts = StepParts(module, args, backend, hooks, progress, losses, collector)
        parts.bind(forward, wrapped, optimizers, schedules, loader_length=len(loader))
        batch = parts.next_batch(iter(loader))
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
        self.first_loss_checked = False
        self.forward: Any = None
        self.device = backend.device
        self.wrapped: torch.nn.Module = module
        self.parameters: List[torch.nn.Parameter] = []
        self.gradient_accumulators: List[Any] = []  # kept alive: not rebuilt every step
        self.optimizers: Sequence[torch.optim.Optimizer] = ()
        self.schedules = LRSchedules()
        self.sync_every_batch = False  # a stream: its last micro-batch is not known ahead
        self.clips = False  # clip_grads (or the module's max_grad_norm), track_grad_norm or clip_grad_value
        self.max_grad_norm: Optional[float] = None  # TrainerArguments' when clip_grads, else the module's own
        # The backend's calls, or None / the plain call where nothing overrides them (bind):
        self.no_sync: Optional[Callable[..., Any]] = backend.no_sync
        self.backward: Callable[[torch.Tensor], None] = backend.backward
        self.unscale_gradients: Optional[Callable[..., None]] = backend.unscale_gradients
        self.step_optimizers: Callable[..., bool] = backend.step_optimizers
        self.next_batch: Callable[[Any], Any] = self._next_batch

    def bind(
        self,
        forward: Any,
        wrapped: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedules: LRSchedules,
        loader_length: Optional[int],
    ) -> None:
        """Hand over what steps run on (again after the train loader changed)."""
        self.forward, self.wrapped, self.optimizers, self.schedules = forward, wrapped, optimizers, schedules
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        self.gradient_accumulators = gradient_accumulators(self.parameters)
        self.sync_every_batch = loader_length is None
        self.next_batch = self._next_batch_of_stream if self.sync_every_batch else self._next_batch
        args = self.args
        self.max_grad_norm = args.max_grad_norm if args.clip_grads else module_max_grad_norm(self.module)
        self.clips = bool(self.max_grad_norm is not None or args.track_grad_norm or args.clip_grad_value is not None)
        backend, plain = self.backend, self.backend.is_plain
        self.no_sync = None if plain("no_sync") else backend.no_sync
        self.backward = torch.Tensor.backward if plain("backward") else backend.backward
        self.unscale_gradients = None if plain("unscale_gradients") else backend.unscale_gradients
        self.step_optimizers = backend.precision.step_optimizers if plain("step_optimizers") else backend.step_optimizers

    def _next_batch(self, batches: Any) -> Any:
        """The loader's next batch on the device; None at its end."""
        batch = next(batches, None)
        return None if batch is None else self.backend.move_to_device(batch)

    def _next_batch_of_stream(self, batches: Any) -> Any:
        """As :meth:`_next_batch`, but every rank stops when the first runs out (the others
        would wait in an all-reduce)."""
        batch = next(batches, None)
        if not self.backend.all_ranks_have_batch(batch is not None):
            return None
        return None if batch is None else self.backend.move_to_device(batch)

    def check_first_loss(self, loss: torch.Tensor) -> None:
        """Refuse a first loss without a graph (once per run)."""
        checks.check_loss_requires_grad(loss, self.module)
        self.first_loss_checked = True

    def record(self, step: int, outputs: Tuple[Any, ...]) -> None:
        """After a micro-batch: keep the loss on the device (and the outputs when asked);
        ``on_end_train_step``."""
        self.losses.add(outputs[0], step)
        if self.args.collect_train_outputs:
            self.kept_outputs.append(map_tensors(outputs, torch.Tensor.detach))
        self.hooks.call("on_end_train_step", step, *outputs)

    def update(self, cycle_length: int, seen: int) -> None:
        """The end of an accumulation cycle of ``seen`` micro-batches: the mean over them when a
        stream ended inside the cycle, then unscale, clip, step the optimizers and schedulers."""
        if seen < cycle_length:
            self.mean_over_seen(cycle_length, seen)
        if self.unscale_gradients is not None:
            self.unscale_gradients(self.optimizers)
        if self.clips:
            self.clip_gradients()
        self.step_optimizers_and_schedules()

    def mean_over_seen(self, cycle_length: int, seen: int) -> None:
        """A stream ended inside the cycle: the gradients become the mean over the ``seen``
        micro-batches (each backward was divided by ``cycle_length``)."""
        for parameter in self.parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(cycle_length / seen)

    def clip_gradients(self) -> None:
        """Clip by value and/or norm as the arguments ask; log the norm with ``track_grad_norm``."""
        args = self.args
        max_norm = self.max_grad_norm
        if max_norm is None and args.track_grad_norm:
            max_norm = float("inf")
        grad_norm = self.backend.clip_gradients(self.parameters, max_norm, args.clip_grad_value)  # whatever the meshes
        if grad_norm is not None and args.track_grad_norm:
            self.collector.log("grad_norm", grad_norm, on_step=True, on_epoch=True)

    def step_optimizers_and_schedules(self, closure: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """Step the optimizers (through the precision), the per-step schedulers when the
        optimizers stepped, and zero the gradients."""
        stepped = self.step_optimizers(self.optimizers, closure)
        if stepped and self.schedules.scheduled:
            try:
                self.schedules.step_per_optimizer_step(self.progress.global_steps_finished + 1)
            except ValueError as error:
                self.explain_schedule_error(error)  # OneCycleLR past total_steps: an extended resumed run
                raise
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


def module_max_grad_norm(module: Any) -> Optional[float]:
    """The module's own clipping norm (``ModuleInterface.max_grad_norm``): None, or a number > 0.

    Raises:
        ValueError: anything else, naming the module and what is allowed.

    Example:
        >>> class Module:
        ...     max_grad_norm = 1.0
        >>> module_max_grad_norm(Module())
        1.0
    """
    norm = getattr(module, "max_grad_norm", None)
    if norm is None:
        return None
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
        raise ValueError(
            f"{type(module).__name__}.max_grad_norm={norm!r} is invalid; allowed: None (no clipping) or a number > 0"
        )
    return float(norm)
