"""The truncated-backprop-through-time step (``tbptt_steps``): each micro-batch chunk by chunk
along time, carrying the (detached) hidden state."""

from typing import Any, Iterator, Tuple

import torch

from backends import map_tensors
from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.steps.parts import StepParts
from framework.loop.tbptt import split_along_time


class TBPTTStep:
    """For each micro-batch of the cycle: split along dim 1 into chunks of ``tbptt_steps``; for
    each chunk, ``train_step(global_step, chunk, device, hiddens)`` and the backward of its share
    of the loss (under ``no_sync`` but for the cycle's last chunk), ``on_end_backward``, the hidden
    state detached for the next chunk. The micro-batch's loss is the chunks' mean. Then, as the
    automatic step: unscale, clip, step the optimizers and per-step schedulers, zero.

    Args:
        parts: what the step runs on, bound by :meth:`StepParts.bind`.

    Example:
        step = TBPTTStep(parts)
        micro_batches = step.run(iter(loader), cycle_length=1)
    """

    def __init__(self, parts: StepParts) -> None:
        if not parts.args.tbptt_steps:
            raise ValueError(f"TBPTTStep needs tbptt_steps >= 1; got {parts.args.tbptt_steps!r}")
        self.parts, self.chunk_length = parts, parts.args.tbptt_steps

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """Forward and backward of up to ``cycle_length`` micro-batches, then one optimizer
        step; returns how many micro-batches there were (0: the stream had ended)."""
        parts = self.parts
        step = parts.progress.global_steps_finished
        seen = 0
        for index in range(cycle_length):
            batch = parts.next_batch(batches)
            if batch is None:
                break  # a stream ran out
            sync = parts.sync_every_batch or index + 1 == cycle_length
            parts.record(step, self.chunk_by_chunk(step, batch, cycle_length, sync))
            seen += 1
        if not seen:
            return 0
        parts.update(cycle_length, seen)
        return seen

    def chunk_by_chunk(self, step: int, batch: Any, cycle_length: int, sync: bool) -> Tuple[Any, ...]:
        """Forward and backward of one micro-batch's chunks, summing their gradients; returns
        ``(mean chunk loss, *the last chunk's other outputs)``."""
        parts = self.parts
        chunks = split_along_time(batch, self.chunk_length)
        hiddens, total_loss = None, 0.0
        for index, chunk in enumerate(chunks):
            last = sync and index + 1 == len(chunks)
            with parts.backend.no_sync(parts.wrapped, skip_gradient_sync=not last):
                outputs = as_outputs(parts.forward(Stage.TRAIN, step, chunk, parts.device, hiddens), "train_step")
                if len(outputs) < 2:
                    raise TypeError(
                        "with tbptt_steps set, train_step(global_step, batch, device, hiddens) must return (loss, hiddens, ...)"
                    )
                if not parts.first_loss_checked:
                    parts.check_first_loss(outputs[0])
                parts.backward(outputs[0] / (cycle_length * len(chunks)))
            parts.hooks.call("on_end_backward", step, outputs[0])
            hiddens = map_tensors(outputs[1], torch.Tensor.detach)
            total_loss = total_loss + outputs[0].detach()
        return (total_loss / len(chunks), *outputs[1:])
