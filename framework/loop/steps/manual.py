"""The manual step (``automatic_optimization = False``): ``train_step`` steps the optimizers."""

from typing import Any, Iterator

from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.steps.parts import StepParts


class ManualStep:
    """One batch per step: ``train_step`` runs its own backward passes and optimizer steps
    (through :class:`~framework.loop.manual_optimization.ManualOptimization`); the step then
    keeps the loss and calls ``on_end_train_step``.

    Args:
        parts: what the step runs on, bound by :meth:`StepParts.bind`.

    Example:
        step = ManualStep(parts)
        micro_batches = step.run(iter(loader), cycle_length=1)
    """

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """``train_step`` on the next batch; returns 1, or 0 when the stream had ended."""
        parts = self.parts
        batch = parts.next_batch(batches)
        if batch is None:
            return 0
        step = parts.progress.global_steps_finished
        parts.record(step, as_outputs(parts.forward(Stage.TRAIN, step, batch, parts.device), "train_step"))
        return 1
