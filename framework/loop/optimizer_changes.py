"""Optimizer changes between a checkpoint and the run resuming from it are named, not silently undone.

- Another optimizer class (SGD in the checkpoint, Adam now) is an error before step 1
  (:func:`check_optimizer_classes`): one class's state does not fit another's.
- A changed hyperparameter (momentum 0 in the checkpoint, 0.9 configured now) is a warning
  naming it and both values, and the configured value is used
  (:class:`ConfiguredHyperparameters`): the user edited the config on purpose.
- What a learning-rate scheduler drives is not a change: ``lr`` under a scheduler (and
  ``momentum``/``betas`` under a cycling one) comes back as the checkpoint scheduled it.
  A changed base of the schedule (``initial_lr``, ``max_lr``...) is a warning, and the
  checkpoint's schedule is kept (the scheduler's state holds it).
"""

import copy
import logging
from typing import Any, Collection, Dict, List, Optional, Sequence

import torch

from framework.loop.module_checks import CheckpointMismatch

logger = logging.getLogger("framework")

OPTIMIZER_TYPES_KEY = "optimizer_types"
"""The key of the optimizers' class names in the trainer's checkpoint state."""

_CYCLED_MOMENTUM = ("momentum", "betas")  # what OneCycleLR/CyclicLR drive with cycle_momentum
_SCHEDULE_BASES = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")  # written by schedulers
_HOW_TO_START_FRESH = (
    "To keep the checkpoint's model weights and start the optimizers, schedulers and counters afresh, set "
    "checkpointer_args.reset_optimizers_schedulers=True (--checkpointer.reset_optimizers_schedulers true) and load it "
    "with load_filename/load_dir in a new output_dir"
)


def optimizer_types(optimizers: Sequence[torch.optim.Optimizer]) -> List[str]:
    """Each optimizer's class, as ``module.QualifiedName`` (kept in checkpoints).

    Example:
        >>> optimizer_types([torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)])
        ['torch.optim.sgd.SGD']
    """
    return [f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" for optimizer in optimizers]


def check_optimizer_classes(
    saved_trainer_state: Dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], checkpoint_path: Optional[str]
) -> None:
    """Refuse to resume optimizers of another class than the checkpoint's (checkpoints from
    before classes were recorded pass).

    Raises:
        CheckpointMismatch: names the optimizer, both classes and how to start fresh optimizers.

    Example:
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> check_optimizer_classes({"optimizer_types": ["torch.optim.adam.Adam"]}, [sgd], "ckpt.pt")
        Traceback (most recent call last):
        ...
        framework.loop.module_checks.CheckpointMismatch: checkpoint ckpt.pt holds optimizer 0 of class Adam ... SGD ...
    """
    saved = saved_trainer_state.get(OPTIMIZER_TYPES_KEY)
    if saved is None:
        return
    for index, (was, now) in enumerate(zip(saved, optimizer_types(optimizers))):
        if was != now:
            raise CheckpointMismatch(
                f"checkpoint {checkpoint_path or ''} holds optimizer {index} of class {_short(was)} ({was}), and "
                f"get_optimizers_schedulers now returns {_short(now)} ({now}): the state of one optimizer class does not "
                f"fit another. To resume, return {_short(was)} again. {_HOW_TO_START_FRESH}"
            )


class ConfiguredHyperparameters:
    """This run's configured hyperparameters, taken before a checkpoint is loaded, put back after.

    Args:
        optimizers: the run's optimizers, as ``get_optimizers_schedulers`` built them (their
            schedulers created, nothing loaded yet).

    Example:
        >>> parameter = torch.nn.Parameter(torch.zeros(1))
        >>> optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9)
        >>> configured = ConfiguredHyperparameters([optimizer])
        >>> optimizer.load_state_dict(torch.optim.SGD([parameter], lr=0.1, momentum=0.0).state_dict())
        >>> configured.restore([optimizer])  # warns: momentum 0.0 in the checkpoint, 0.9 configured
        >>> optimizer.param_groups[0]["momentum"]
        0.9
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.groups = [
            [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in optimizers
        ]

    def restore(self, optimizers: Sequence[torch.optim.Optimizer], driven: Collection[str] = ()) -> None:
        """After ``load_state_dict``: name every hyperparameter the checkpoint changed, put the
        configured value back (except what a scheduler owns: see the module docstring, and the
        ``driven`` keys a callback sets itself, e.g. SWA's annealed ``lr``: kept, not warned about)."""
        for index, (optimizer, configured_groups) in enumerate(zip(optimizers, self.groups)):
            name = type(optimizer).__name__
            for group_index, (group, configured) in enumerate(zip(optimizer.param_groups, configured_groups)):
                where = f"optimizer {index} ({name})" + (f" parameter group {group_index}" if len(configured_groups) > 1 else "")
                for key, value in configured.items():
                    if key not in group:  # a checkpoint of an older torch: the configured value
                        group[key] = value
                    elif key in driven:
                        continue
                    elif not _scheduled(key, configured, group) and not _same(group[key], value):
                        _report(where, key, group[key], value, owned_by_schedule=key in _SCHEDULE_BASES)
                        if key not in _SCHEDULE_BASES:
                            group[key] = value


def _scheduled(key: str, configured: Dict[str, Any], loaded: Dict[str, Any]) -> bool:
    """True for what a scheduler drives step by step: lr (when scheduled), cycled momentum."""
    if key == "lr":
        return "initial_lr" in configured or "initial_lr" in loaded
    if key in _CYCLED_MOMENTUM:
        return "base_momentum" in configured or "base_momentum" in loaded
    return False


def _report(where: str, key: str, saved: Any, configured: Any, owned_by_schedule: bool) -> None:
    if owned_by_schedule:
        logger.warning(
            "%s: %s is %r in the checkpoint and %r in this run's schedule; the checkpoint's schedule is kept (its "
            "scheduler state holds it). To use the new schedule, start the optimizers and schedulers afresh "
            "(checkpointer_args.reset_optimizers_schedulers with load_filename/load_dir)",
            where,
            key,
            _plain(saved),
            _plain(configured),
        )
    else:
        logger.warning(
            "%s: %s is %r in the checkpoint and %r in this run's configuration; using the configured %r",
            where,
            key,
            _plain(saved),
            _plain(configured),
            _plain(configured),
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a).cpu().double(), torch.as_tensor(b).cpu().double()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return tuple(_plain(item) for item in value) if isinstance(value, (list, tuple)) else value


def _short(qualified: str) -> str:
    return qualified.rsplit(".", 1)[-1]
