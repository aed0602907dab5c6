"""The automatic step: accumulate a cycle's micro-batches, then one optimizer step."""

from typing import Any, Iterator, Tuple

from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.steps.parts import StepParts


class AutomaticStep:
    """For each micro-batch of the cycle: the next batch (on the device), forward and backward
    (all but the cycle's last under ``no_sync``; the loss divided by the cycle's length),
    ``on_end_backward``, the loss kept, ``on_end_train_step``. Then unscale, clip, step the
    optimizers and the per-step schedulers, and zero the gradients.

    Args:
        parts: what the step runs on, bound by :meth:`StepParts.bind`.

    Example:
        step = AutomaticStep(parts)
        micro_batches = step.run(iter(loader), cycle_length=4)  # 0: the stream had ended
    """

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """Forward and backward of up to ``cycle_length`` micro-batches, then one optimizer
        step; returns how many micro-batches there were (0: the stream had ended)."""
        parts = self.parts
        step, no_sync = parts.progress.global_steps_finished, parts.no_sync
        seen = 0
        for index in range(cycle_length):
            batch = parts.next_batch(batches)
            if batch is None:
                break  # a stream ran out
            if no_sync is None:
                outputs = self.forward_backward(step, batch, cycle_length)
            else:
                sync = parts.sync_every_batch or index + 1 == cycle_length
                with no_sync(parts.wrapped, skip_gradient_sync=not sync):
                    outputs = self.forward_backward(step, batch, cycle_length)
            parts.hooks.call("on_end_backward", step, outputs[0])
            parts.record(step, outputs)
            seen += 1
        if not seen:
            return 0
        parts.update(cycle_length, seen)
        return seen

    def forward_backward(self, step: int, batch: Any, cycle_length: int) -> Tuple[Any, ...]:
        """``train_step`` on one micro-batch and the backward of its share of the loss."""
        parts = self.parts
        outputs = as_outputs(parts.forward(Stage.TRAIN, step, batch, parts.device), "train_step")
        if not parts.first_loss_checked:
            parts.check_first_loss(outputs[0])
        parts.backward(outputs[0] / cycle_length if cycle_length > 1 else outputs[0])
        return outputs
