"""The closure step: optimizers that re-evaluate the loss themselves (``torch.optim.LBFGS``)."""

from typing import Any, Iterator, List, Tuple

import torch

from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.steps.parts import StepParts


class ClosureStep:
    """One batch per optimizer step. The optimizers step with a closure that zeroes the
    gradients, runs ``train_step`` and its backward, and clips; the optimizer calls it as often
    as it needs. The first evaluation's outputs are the step's: ``on_end_backward`` once, the
    loss kept, ``on_end_train_step``.

    Args:
        parts: what the step runs on, bound by :meth:`StepParts.bind`.

    Example:
        step = ClosureStep(parts)
        micro_batches = step.run(iter(loader), cycle_length=1)
    """

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """One optimizer step on the next batch; returns 1, or 0 when the stream had ended
        (``cycle_length`` is always 1: the trainer refuses accumulation with a closure)."""
        parts = self.parts
        batch = parts.next_batch(batches)
        if batch is None:
            return 0
        step = parts.progress.global_steps_finished
        first_outputs: List[Tuple[Any, ...]] = []

        def closure() -> torch.Tensor:
            for optimizer in parts.optimizers:
                optimizer.zero_grad(set_to_none=False)
            outputs = as_outputs(parts.forward(Stage.TRAIN, step, batch, parts.device), "train_step")
            if not parts.first_loss_checked:
                parts.check_first_loss(outputs[0])
            parts.backend.backward(outputs[0])
            parts.clip_gradients()
            if not first_outputs:
                first_outputs.append(outputs)
                parts.hooks.call("on_end_backward", step, outputs[0])
            return outputs[0]

        parts.step_optimizers_and_schedules(closure)
        parts.record(step, first_outputs[0])
        return 1
