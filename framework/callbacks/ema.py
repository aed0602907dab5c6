"""EMA: an exponential moving average of the weights, updated after optimizer steps."""

from typing import Callable, List

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from framework.callbacks.weight_averaging import WeightAveraging


def _ema_of_floats(decay: float) -> Callable[..., None]:
    """torch's EMA ``multi_avg_fn`` for floating tensors; integer buffers (a batch norm's
    ``num_batches_tracked``) are copied, as a weighted sum would truncate them."""
    ema = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(averaged: List[torch.Tensor], current: List[torch.Tensor], count: torch.Tensor) -> None:
        if torch.is_floating_point(averaged[0]) or torch.is_complex(averaged[0]):
            ema(averaged, current, count)
        else:
            torch._foreach_copy_(averaged, current)

    return update


class EMA(WeightAveraging):
    """An exponential moving average of the module's weights (and buffers).

    After every ``every_n_steps``-th optimizer step: ``average = decay * average + (1 - decay)
    * weights`` (``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``); the
    first update copies the weights. With ``use_for_validation`` validation and test evaluate
    the average (the training weights come back after each loader); ``with ema.applied():``
    does the same around anything else (``trainer.predict()``, an export). The average is
    saved in checkpoints and restored on resume; it is identical on every ``ddp`` rank and
    sharded like the parameters under ``fsdp``.

    Args:
        decay: weight of the old average, in [0, 1].
        every_n_steps: average after every n-th optimizer step (>= 1).
        use_for_validation: evaluate the average in validation and test.

    Example:
        >>> from framework.callbacks import EMA
        >>> ema = EMA(decay=0.999)
        >>> # trainer = Trainer(module, args, callbacks=[ema]); trainer.train()
        >>> # ema.averaged_state_dict()  -> the averaged weights under the module's names
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1, use_for_validation: bool = True) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay={decay!r} is invalid; allowed: a number in [0, 1] (e.g. 0.999)")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"EMA every_n_steps={every_n_steps!r} is invalid; allowed: an integer >= 1")
        super().__init__(_ema_of_floats(float(decay)), use_buffers=True, use_for_validation=use_for_validation)
        self.decay = float(decay)
        self.every_n_steps = every_n_steps

    def should_update(self, global_step: int) -> bool:
        return global_step % self.every_n_steps == 0
