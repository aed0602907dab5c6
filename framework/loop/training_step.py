"""One optimizer step: the path of a batch from the loader to the optimizer.

:class:`TrainingStep` is what the trainer holds; :meth:`TrainingStep.prepare` chooses, once, the
class that runs each step (``framework/loop/steps/``), and ``TrainingStep.run`` *is* that class's
``run``:

- :class:`~framework.loop.steps.manual.ManualStep` with ``automatic_optimization = False``;
- :class:`~framework.loop.steps.closure.ClosureStep` with an LBFGS-like optimizer;
- :class:`~framework.loop.steps.tbptt.TBPTTStep` with ``tbptt_steps``;
- :class:`~framework.loop.steps.pipeline.PipelineStep` under a pipeline (``pipeline_parallel_size > 1``);
- :class:`~framework.loop.steps.automatic.AutomaticStep` otherwise.
"""

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.loop.hooks import HookDispatcher
from framework.loop.schedulers import LRSchedules
from framework.loop.steps.automatic import AutomaticStep
from framework.loop.steps.closure import ClosureStep
from framework.loop.steps.manual import ManualStep
from framework.loop.steps.parts import StepParts
from framework.loop.steps.pipeline import PipelineStep, check_pipeline_module
from framework.loop.steps.tbptt import TBPTTStep
from framework.loop.training_state import TrainingProgress
from framework.metrics.collector import MetricCollector
from framework.metrics.loss_tracker import LossTracker
from framework.module import ModuleInterface

StepMode = Union[AutomaticStep, TBPTTStep, ClosureStep, ManualStep, PipelineStep]


def step_mode(automatic: bool, closure: bool, tbptt_steps: Optional[int]) -> Type[StepMode]:
    """The class that runs each step: manual first, then a closure, then TBPTT, else automatic.

    Example:
        >>> step_mode(automatic=True, closure=False, tbptt_steps=None).__name__
        'AutomaticStep'
    """
    if not automatic:
        return ManualStep
    if closure:
        return ClosureStep
    return TBPTTStep if tbptt_steps else AutomaticStep


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
        step = TrainingStep(
            module=module, args=args, backend=backend, hooks=hooks, progress=progress, losses=losses, collector=collector
        )
        step.prepare(forward, wrapped, optimizers, schedules, automatic=True, loader_length=len(loader))
        micro_batches = step.run(iter(loader), cycle_length=4)
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        args: TrainerArguments,
        backend: TrainerBackend,
        hooks: HookDispatcher,
        progress: TrainingProgress,
        losses: LossTracker,
        collector: MetricCollector,
    ) -> None:
        self.parts = StepParts(module, args, backend, hooks, progress, losses, collector)
        self.mode: Optional[StepMode] = None
        self.run: Callable[[Iterator[Any], int], int] = self._unprepared
        self._closure = False

    @property
    def kept_outputs(self) -> List[Tuple[Any, ...]]:
        """Each micro-batch's outputs (detached) with ``collect_train_outputs``, until the epoch ends."""
        return self.parts.kept_outputs

    @kept_outputs.setter
    def kept_outputs(self, value: List[Tuple[Any, ...]]) -> None:
        self.parts.kept_outputs = value

    @property
    def explain_schedule_error(self) -> Callable[[ValueError], None]:
        """Called with a scheduler's ``ValueError`` before it propagates (names an exhausted schedule)."""
        return self.parts.explain_schedule_error

    @explain_schedule_error.setter
    def explain_schedule_error(self, value: Callable[[ValueError], None]) -> None:
        self.parts.explain_schedule_error = value

    def prepare(
        self,
        forward: Any,
        wrapped: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedules: LRSchedules,
        automatic: bool,
        loader_length: Optional[int],
    ) -> None:
        """Hand over what steps run on (again after the train loader changed) and choose the
        step's class; ``run`` is then that class's ``run``."""
        self.parts.bind(forward, wrapped, optimizers, schedules, loader_length)
        self._closure = any(isinstance(optimizer, torch.optim.LBFGS) for optimizer in optimizers)
        if getattr(self.parts.backend.strategy, "pipelined", False):  # refused before step 1: what a schedule cannot run
            check_pipeline_module(self.parts.module, self.parts.args, automatic, self._closure)
            self.mode = PipelineStep(self.parts)
        else:
            self.mode = step_mode(automatic, self._closure, self.parts.args.tbptt_steps)(self.parts)
        self.run = self.mode.run

    @property
    def uses_closure(self) -> bool:
        """True when an optimizer re-evaluates the loss itself (LBFGS)."""
        return self._closure

    def clip_gradients(self) -> None:
        """Clip by value and/or norm as the arguments ask; log the norm with ``track_grad_norm``."""
        self.parts.clip_gradients()

    def _unprepared(self, batches: Iterator[Any], cycle_length: int) -> int:
        raise RuntimeError("TrainingStep.run before prepare(): the trainer hands it the module and optimizers first")
