"""What steps return: normalising it and joining it over steps."""

from collections.abc import Mapping
from typing import Any, List, Tuple

import torch


def as_outputs(value: Any, method: str) -> Tuple[Any, ...]:
    """Normalise what a step returned to a tuple whose first item is the loss.

    A tensor becomes ``(loss,)``, a tuple or list stays as it is, and a dict with ``"loss"``
    becomes ``(loss, other_items)``.

    Raises:
        TypeError: anything else, naming ``method`` and the type it returned.
    """
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return tuple(value)
    if isinstance(value, dict) and isinstance(value.get("loss"), torch.Tensor):
        return (value["loss"], {key: item for key, item in value.items() if key != "loss"})
    raise TypeError(
        f"{method} must return a loss tensor, a tuple/list whose first item is the loss tensor, "
        f"or a dict with a 'loss' tensor; got {type(value).__name__}"
        + (f" with first item {type(value[0]).__name__}" if isinstance(value, (tuple, list)) and value else "")
    )


def concatenate_outputs(per_step: List[Tuple[Any, ...]]) -> Tuple[Any, ...]:
    """Join each output position over steps: tensors with a batch dim are concatenated,
    0-d tensors stacked, dicts joined key by key (the same rules inside), anything else listed.

    Example:
        >>> concatenate_outputs([(torch.ones(2), {"p": torch.ones(2)}), (torch.zeros(1), {"p": torch.zeros(1)})])
        (tensor([1., 1., 0.]), {'p': tensor([1., 1., 0.])})
    """
    return tuple(_join(list(parts)) for parts in zip(*per_step))


def _join(parts: List[Any]) -> Any:
    if parts and all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1) for p in parts])
    if parts and all(isinstance(p, Mapping) for p in parts) and all(p.keys() == parts[0].keys() for p in parts):
        return {key: _join([p[key] for p in parts]) for key in parts[0]}
    return list(parts)
