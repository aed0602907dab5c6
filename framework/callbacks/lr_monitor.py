"""LearningRateMonitor: record the learning rate of every optimizer's parameter groups."""

from typing import Dict, List, Optional

import torch

from framework.callbacks.base import Callback

_INTERVALS = ("step", "epoch")


def learning_rates(optimizers: List[torch.optim.Optimizer], prefix: str = "lr") -> Dict[str, float]:
    """``{name: lr}`` for every parameter group.

    Names: ``lr`` for one optimizer with one group; ``lr/opt{i}`` when there are several
    optimizers; ``/group{j}`` is appended when an optimizer has several groups.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> learning_rates([torch.optim.SGD(net.parameters(), lr=0.1)])
        {'lr': 0.1}
    """
    rates = {}
    for index, optimizer in enumerate(optimizers):
        name = prefix if len(optimizers) == 1 else f"{prefix}/opt{index}"
        groups = optimizer.param_groups
        for group_index, group in enumerate(groups):
            rates[name if len(groups) == 1 else f"{name}/group{group_index}"] = float(group["lr"])
    return rates


class LearningRateMonitor(Callback):
    """Record each parameter group's learning rate as a metric (``lr``, ``lr/opt1/group0``...).

    With ``interval="step"`` the rates are recorded at every ``log_every_n_steps`` point and
    are the rates the optimizer step just taken used; with ``"epoch"``, once at the start of
    each epoch; with None (the default, as Lightning's), at the schedulers' own interval:
    ``"epoch"`` when every scheduler steps per epoch, else ``"step"`` (also without schedulers).
    Rates are Python floats on the host: no device sync.

    Args:
        interval: ``"step"``, ``"epoch"`` or None.
        prefix: metric name prefix.
        logging_interval: Lightning's name for ``interval`` (give one of the two).

    Example:
        >>> LearningRateMonitor(logging_interval="epoch").interval  # Lightning's spelling
        'epoch'
        >>> LearningRateMonitor(interval="epoch", logging_interval="step")
        Traceback (most recent call last):
        ...
        ValueError: LearningRateMonitor interval='epoch' and logging_interval='step' disagree; give one of them ...
    """

    def __init__(self, interval: Optional[str] = None, prefix: str = "lr", logging_interval: Optional[str] = None) -> None:
        if interval is not None and logging_interval is not None and interval != logging_interval:
            raise ValueError(
                f"LearningRateMonitor interval={interval!r} and logging_interval={logging_interval!r} disagree; "
                "give one of them (logging_interval is Lightning's name for interval)"
            )
        name, chosen = ("interval", interval) if interval is not None else ("logging_interval", logging_interval)
        if chosen is not None and chosen not in _INTERVALS:
            raise ValueError(f"LearningRateMonitor {name}={chosen!r} is invalid; allowed: {_INTERVALS} or None")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"LearningRateMonitor prefix={prefix!r} is invalid; allowed: a non-empty string")
        self.interval: Optional[str] = chosen
        """``"step"``, ``"epoch"``, or None until training starts (then the schedulers' interval)."""
        self.prefix = prefix
        self._asked = chosen
        self._pending: Dict[str, float] = {}

    def on_begin_train(self, global_step: int) -> None:
        if self._asked is None:  # Lightning's None: the schedulers' own interval
            scheduled = self.trainer.lr_schedules.scheduled
            epochly = bool(scheduled) and all(entry.interval == "epoch" for entry in scheduled)
            self.interval = "epoch" if epochly else "step"

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        # The optimizer step about to happen ends step global_step + 1: if that is a log
        # point, keep the rates it uses (schedulers change them right after the step).
        if self.interval == "step" and (global_step + 1) % self.trainer.args.log_every_n_steps == 0:
            self._pending = learning_rates(self.trainer.optimizers, self.prefix)

    def on_end_optimizer_step(self, global_step: int) -> None:
        if self.interval != "step" or global_step % self.trainer.args.log_every_n_steps:
            return
        rates, self._pending = self._pending or learning_rates(self.trainer.optimizers, self.prefix), {}
        self.trainer.log_metrics(rates)

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        if self.interval == "epoch":
            self.trainer.log_metrics(learning_rates(self.trainer.optimizers, self.prefix))
