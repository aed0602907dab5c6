"""Non-finite values in checkpoints: finding NaN/inf in weights, and ranking scores so they are never "best"."""

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch


def is_finite_score(value: Optional[float]) -> bool:
    """True for a real, finite number (None, NaN and +/-inf are not).

    Example:
        >>> is_finite_score(0.5), is_finite_score(float("nan")), is_finite_score(float("-inf")), is_finite_score(None)
        (True, False, False, False)
    """
    if value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def best_first(scores: Dict[str, float], mode: str) -> List[str]:
    """Names of the finite scores, best first for ``mode`` (``"min"`` or ``"max"``).

    NaN and +/-inf rank worst in both modes: they are left out, so a diverged checkpoint is
    never kept or returned as the best one.

    Example:
        >>> best_first({"a": 2.0, "b": float("nan"), "c": 1.0, "d": float("-inf")}, "min")
        ['c', 'a']
        >>> best_first({"a": 2.0, "b": float("inf"), "c": 1.0}, "max")
        ['a', 'c']
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}; allowed: 'min', 'max'")
    finite = [name for name, value in scores.items() if is_finite_score(value)]
    return sorted(finite, key=lambda name: float(scores[name]), reverse=mode == "max")


def _tensors(obj: Any, prefix: str) -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{index}" if prefix else str(index))


def first_non_finite_tensor(state: Any) -> Optional[str]:
    """The dotted name of the first floating-point tensor in ``state`` holding a NaN or inf, or None.

    One device synchronisation per device: every tensor's check is reduced on its device first.
    Plain strided tensors are checked (tensor subclasses, sparse and meta tensors are not).

    Example:
        >>> first_non_finite_tensor({"model": {"w": torch.ones(2), "b": torch.tensor([0.0, float("nan")])}})
        'model.b'
        >>> first_non_finite_tensor({"model": {"w": torch.ones(2), "steps": torch.tensor(3)}}) is None
        True
    """
    by_device: Dict[torch.device, List[Tuple[str, torch.Tensor]]] = {}
    for name, tensor in _tensors(state, ""):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided or tensor.is_meta:
            continue
        if tensor.is_floating_point() or tensor.is_complex():
            by_device.setdefault(tensor.device, []).append((name, torch.isfinite(tensor.detach()).all()))
    for checks in by_device.values():
        flags = torch.stack([flag for _, flag in checks])
        if not bool(flags.all()):
            return checks[int((~flags).nonzero()[0])][0]
    return None
