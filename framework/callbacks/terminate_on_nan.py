"""TerminateOnNaN: stop before a NaN or infinite loss reaches the weights or a checkpoint."""

import logging
from typing import Optional

import torch

from framework.callbacks.base import Callback, StopTraining

logger = logging.getLogger(__name__)


class TerminateOnNaN(Callback):
    """Check every micro-batch's loss after backward; stop on NaN or infinity.

    The check runs before the optimizer step, so the bad gradients are never applied, and
    it raises :class:`StopTraining` with ``save_checkpoint=False``, so no checkpoint is
    written after it: the newest checkpoint on disk is the last good one. The message names
    the step. Reading the loss back costs one host-device sync per micro-batch (and under
    DDP one tiny all-reduce, so all ranks stop together); that cost exists only when this
    callback is used.

    Example:
        trainer = Trainer(module, args, callbacks=[TerminateOnNaN()])
        trainer.train()
        trainer.callbacks[-1].stopped_step
    """

    def __init__(self) -> None:
        self.stopped_step: Optional[int] = None

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        local_finite = torch.isfinite(loss.detach()).all()
        finite = self.trainer.backend.all_reduce(local_finite.float(), "min")  # a no-op on one rank
        if bool(finite):
            return
        self.stopped_step = global_step
        what = "a non-finite loss on another rank" if bool(local_finite) else f"loss={loss.detach().float().sum().item()}"
        message = (
            f"{what} at global_step={global_step} (epoch {self.trainer.epochs_finished}); stopped before the "
            f"optimizer applied it, no checkpoint saved after {global_step} optimizer steps"
        )
        logger.warning("TerminateOnNaN: %s", message)
        raise StopTraining(message, save_checkpoint=False)
