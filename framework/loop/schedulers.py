"""Building the optimizers and schedulers a module asks for, and stepping the schedulers.

``get_optimizers_schedulers`` returns ``([optimizers], [schedulers])``. Each scheduler is
either a bare scheduler object or, as in Lightning, a dict::

    {"scheduler": s, "interval": "step" | "epoch", "frequency": n, "monitor": "val_loss"}

A bare scheduler steps per ``TrainerArguments.scheduler_interval`` (default: after every
optimizer step); a bare ``ReduceLROnPlateau`` steps once per epoch on the value of
``TrainerArguments.scheduler_monitor`` recorded in that epoch (its last validation). When a
scheduler steps is derived from the global step and the epoch alone, so a resumed run steps
them exactly where an uninterrupted run would; only their own ``state_dict`` is checkpointed.
"""

import dataclasses
import logging
from typing import Any, List, Optional, Sequence, Tuple

import torch

from framework.loop.module_checks import check_optimizers_schedulers

logger = logging.getLogger("framework")

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau
_INTERVALS = ("step", "epoch")
_DICT_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")


@dataclasses.dataclass
class ScheduledLR:
    """One scheduler and when the trainer steps it.

    Attributes:
        scheduler: the scheduler object (``step()``, ``state_dict()``).
        interval: ``"step"``: counted in optimizer steps; ``"epoch"``: counted in epochs.
        frequency: step it every ``frequency`` intervals (the step or epoch number is a multiple of it).
        monitor: the metric a ``ReduceLROnPlateau`` is stepped with (ignored by other schedulers).
        strict: a missing ``monitor`` value is an error (False: a warning, and the step is skipped).
        name: a label for the start-of-run log.
        monitor_source: how ``monitor`` was chosen, for error messages.

    ``ReduceLROnPlateau`` with ``interval="epoch"`` steps at the end of every ``frequency``-th
    epoch with the newest value of ``monitor`` recorded in that epoch (the epoch's last
    validation); an epoch that recorded none (no validation in it) is skipped. With
    ``interval="step"`` it steps after every validation at a step that is a multiple of
    ``frequency``, with the value recorded at that step.

    Example:
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> scheduled = ScheduledLR(torch.optim.lr_scheduler.StepLR(optimizer, 30), interval="epoch")
        >>> scheduled.describe(0)
        'scheduler 0: StepLR, every epoch'
    """

    scheduler: Any
    interval: str
    frequency: int = 1
    monitor: Optional[str] = None
    strict: bool = True
    name: Optional[str] = None
    monitor_source: str = "monitor"

    @property
    def is_plateau(self) -> bool:
        """True for ``ReduceLROnPlateau``, which is stepped with a metric value."""
        return isinstance(self.scheduler, _PLATEAU)

    def due(self, count: int) -> bool:
        """Whether step (or epoch) number ``count`` (counting from 1) is one this scheduler steps at."""
        return count % self.frequency == 0

    def describe(self, index: int) -> str:
        """One line: which scheduler and when it steps, e.g. ``scheduler 1: ReduceLROnPlateau on val_loss, every epoch``."""
        kind = type(self.scheduler).__name__ + (f" ({self.name})" if self.name else "")
        if self.is_plateau:
            kind += f" on {self.monitor}"
        if self.is_plateau and self.interval == "step":
            when = "after every validation" + (f" at a multiple of {self.frequency} steps" if self.frequency > 1 else "")
        else:
            when = f"every {self.interval}" if self.frequency == 1 else f"every {self.frequency} {self.interval}s"
        return f"scheduler {index}: {kind}, {when}"


class LRSchedules:
    """The run's schedulers with their intervals, and the three points where they step.

    The trainer calls :meth:`step_per_optimizer_step` after each optimizer step that was taken
    (not one a GradScaler skipped), :meth:`step_after_validation` after each validation during
    training, and :meth:`step_per_epoch` at the end of each completed epoch (after its
    validation). Under manual optimization it calls none of them.

    Args:
        scheduled: one :class:`ScheduledLR` per scheduler, in the order the module returned them.

    Example:
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        >>> schedules = LRSchedules([ScheduledLR(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "step", frequency=2)])
        >>> for step in (1, 2, 3, 4):
        ...     optimizer.step(); schedules.step_per_optimizer_step(step)
        >>> optimizer.param_groups[0]["lr"]
        0.25
    """

    def __init__(self, scheduled: Sequence[ScheduledLR] = ()) -> None:
        self.scheduled = list(scheduled)

    @property
    def schedulers(self) -> List[Any]:
        """The scheduler objects, in order (what checkpoints save and ``trainer.schedulers`` lists)."""
        return [entry.scheduler for entry in self.scheduled]

    def describe(self, automatic_optimization: bool = True) -> List[str]:
        """One line per scheduler for the start-of-run log."""
        if not automatic_optimization:
            return [
                f"scheduler {index}: {type(entry.scheduler).__name__}, stepped by train_step (manual optimization)"
                for index, entry in enumerate(self.scheduled)
            ]
        return [entry.describe(index) for index, entry in enumerate(self.scheduled)]

    def step_per_optimizer_step(self, global_step: int) -> None:
        """After optimizer step number ``global_step`` (from 1): step the due ``"step"`` schedulers."""
        for entry in self.scheduled:
            if entry.interval == "step" and not entry.is_plateau and entry.due(global_step):
                entry.scheduler.step()

    def step_after_validation(self, global_step: int, history: Any) -> None:
        """After a validation at ``global_step``: step the due ``ReduceLROnPlateau`` of interval ``"step"``
        with its ``monitor`` value recorded at that step."""
        for index, entry in enumerate(self.scheduled):
            if entry.is_plateau and entry.interval == "step" and entry.due(global_step):
                value = _recorded(history, entry.monitor, lambda record: record["step"] == global_step)
                if value is None:
                    _missing_monitor(index, entry, history, f"at step {global_step}")
                    continue
                entry.scheduler.step(value)

    def step_per_epoch(self, epoch: int, history: Any, validated_at_epoch_end: bool) -> None:
        """At the end of epoch ``epoch`` (from 0), after its validation: step the due ``"epoch"`` schedulers.

        A ``ReduceLROnPlateau`` gets the newest ``monitor`` value recorded in this epoch. If
        there is none, an epoch that ended with a validation is an error (the name is wrong, or
        the validation does not log it); an epoch without one is skipped.

        Raises:
            ValueError: a monitored metric is missing after this epoch's validation (``strict``).
        """
        for index, entry in enumerate(self.scheduled):
            if entry.interval != "epoch" or not entry.due(epoch + 1):
                continue
            if not entry.is_plateau:
                entry.scheduler.step()
                continue
            value = _recorded(history, entry.monitor, lambda record: record["epoch"] == epoch)
            if value is not None:
                entry.scheduler.step(value)
            elif validated_at_epoch_end:
                _missing_monitor(index, entry, history, f"in epoch {epoch + 1}")


def _recorded(history: Any, name: Optional[str], where: Any) -> Optional[float]:
    for record in reversed(history.records):
        if record["name"] == name and where(record):
            return record["value"]
    return None


def _missing_monitor(index: int, entry: ScheduledLR, history: Any, when: str) -> None:
    message = (
        f"ReduceLROnPlateau (scheduler {index}) monitors {entry.monitor!r} ({entry.monitor_source}), which was not "
        f"recorded {when}; recorded metrics: {history.names()}. Monitor one of them, or log {entry.monitor!r} "
        "(self.log in val_step or a hook)"
    )
    if entry.strict:
        raise ValueError(message)
    logger.warning("%s; skipping this step (strict=False)", message)


def scheduled_lr(
    entry: Any, index: int, default_interval: str, default_monitor: str, method: str = "get_optimizers_schedulers"
) -> ScheduledLR:
    """A :class:`ScheduledLR` from one item of the schedulers list: a scheduler or a Lightning-style dict.

    Raises:
        TypeError, ValueError: a dict without ``"scheduler"``, with an unknown key, or a bad value
            (the message names the key, the value and what is allowed).

    Example:
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        >>> scheduled_lr(plateau, 0, "step", "val_loss").describe(0)
        'scheduler 0: ReduceLROnPlateau on val_loss, every epoch'
        >>> scheduled_lr({"scheduler": plateau, "monitor": "val_acc", "frequency": 2}, 1, "step", "val_loss").describe(1)
        'scheduler 1: ReduceLROnPlateau on val_acc, every 2 epochs'
    """
    if not isinstance(entry, dict):
        plateau = isinstance(entry, _PLATEAU)
        interval = "epoch" if plateau else default_interval
        return ScheduledLR(entry, interval, monitor=default_monitor, monitor_source=f"scheduler_monitor={default_monitor!r}")
    where = f"{method}: scheduler {index}"
    unknown = [key for key in entry if key not in _DICT_KEYS]
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; allowed keys: {list(_DICT_KEYS)}")
    if "scheduler" not in entry:
        raise ValueError(f"{where} is a dict without 'scheduler'; e.g. {{'scheduler': s, 'interval': 'epoch'}}")
    scheduler = entry["scheduler"]
    plateau = isinstance(scheduler, _PLATEAU)
    interval = entry.get("interval", "epoch" if plateau else default_interval)
    if interval not in _INTERVALS:
        raise ValueError(f"{where} has interval={interval!r}; allowed: 'step' or 'epoch'")
    frequency = entry.get("frequency", 1)
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ValueError(f"{where} has frequency={frequency!r}; allowed: an integer >= 1")
    monitor = entry.get("monitor")
    if monitor is not None and not (isinstance(monitor, str) and monitor):
        raise TypeError(f"{where} has monitor={monitor!r}; allowed: a metric name (a non-empty str)")
    strict = entry.get("strict", True)
    if not isinstance(strict, bool):
        raise TypeError(f"{where} has strict={strict!r}; allowed: True or False")
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{where} has name={name!r}; allowed: a str or None")
    source = f'"monitor": {monitor!r}' if monitor is not None else f"scheduler_monitor={default_monitor!r}"
    return ScheduledLR(scheduler, interval, frequency, monitor or default_monitor, strict, name, source)


def build_optimizers_schedules(
    module: Any,
    estimated_global_steps_per_epoch: Optional[int],
    epochs: int,
    default_interval: str = "step",
    default_monitor: str = "val_loss",
) -> Tuple[List[torch.optim.Optimizer], LRSchedules]:
    """``module.get_optimizers_schedulers(...)`` as the optimizers and their :class:`LRSchedules`.

    ``default_interval`` and ``default_monitor`` (``TrainerArguments.scheduler_interval`` and
    ``scheduler_monitor``) apply to bare schedulers and to dicts that leave them out.

    Raises:
        TypeError: the module's method failed on ``estimated_global_steps_per_epoch=None``.
        TypeError, ValueError: not ``([optimizers], [schedulers])``, or a bad scheduler dict.
    """
    returned = lightning_return(_call(module, estimated_global_steps_per_epoch, epochs))
    scheduled: List[ScheduledLR] = []
    if isinstance(returned, (tuple, list)) and len(returned) == 2 and isinstance(returned[1], (list, tuple)):
        scheduled = [scheduled_lr(entry, index, default_interval, default_monitor) for index, entry in enumerate(returned[1])]
        returned = (returned[0], [entry.scheduler for entry in scheduled])
    optimizers, _ = check_optimizers_schedulers(returned)
    return optimizers, LRSchedules(scheduled)


_OUTER_KEYS = ("optimizer", "lr_scheduler", "monitor")


def lightning_return(returned: Any) -> Any:
    """Lightning's ``configure_optimizers`` shapes as ``([optimizers], [schedulers])``: one
    ``{"optimizer": o, "lr_scheduler": s_or_dict, "monitor": m}`` dict, or a list of them;
    anything else is returned as it is (and checked by the caller).

    Raises:
        ValueError: an outer dict without ``"optimizer"`` or with an unknown key.

    Example:
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> step = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        >>> lightning_return({"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "epoch"}})[1]
        [{'scheduler': <torch.optim.lr_scheduler.StepLR object at ...>, 'interval': 'epoch'}]
    """
    entries = [returned] if isinstance(returned, dict) else returned
    if not (isinstance(entries, (list, tuple)) and entries and all(isinstance(entry, dict) for entry in entries)):
        return returned
    optimizers: List[Any] = []
    schedulers: List[Any] = []
    for index, entry in enumerate(entries):
        unknown = [key for key in entry if key not in _OUTER_KEYS]
        if unknown or "optimizer" not in entry:
            raise ValueError(
                f"get_optimizers_schedulers returned a dict (entry {index}) with keys {sorted(entry)}; Lightning's outer "
                f"dict takes {list(_OUTER_KEYS)} and needs 'optimizer'"
            )
        optimizers.append(entry["optimizer"])
        scheduler = entry.get("lr_scheduler")
        if scheduler is None:
            continue
        if "monitor" in entry:
            scheduler = (
                {"monitor": entry["monitor"], **scheduler}
                if isinstance(scheduler, dict)
                else {
                    "scheduler": scheduler,
                    "monitor": entry["monitor"],
                }
            )
        schedulers.append(scheduler)
    return optimizers, schedulers


def _call(module: Any, estimated_global_steps_per_epoch: Optional[int], epochs: int) -> Any:
    """With a train loader of unknown length (a stream), ``estimated_global_steps_per_epoch`` is
    None; a schedule that computes with it fails in user code with a bare ``TypeError``, which
    is re-raised with what to set instead."""
    try:
        return module.get_optimizers_schedulers(estimated_global_steps_per_epoch, epochs)
    except TypeError as error:
        if estimated_global_steps_per_epoch is not None:
            raise
        raise TypeError(
            f"{type(module).__name__}.get_optimizers_schedulers failed with estimated_global_steps_per_epoch=None "
            f"({error}): the train loader has no length (a stream), so the steps per epoch are unknown. Set "
            "TrainerArguments.max_train_steps_per_epoch to an int (the steps per epoch; --trainer.max_train_steps_per_epoch N), "
            "give the dataset a __len__, or build a schedule that does not need the epoch length"
        ) from error
