"""Nested batches: applying a function to every tensor inside tuples, lists and dicts."""

from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with ``fn(tensor)`` in place of every tensor inside it.

    Dicts, tuples (named tuples included) and lists are rebuilt; anything else is returned
    unchanged.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(value, fn)) for key, value in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(value, fn) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(value, fn) for value in obj)
    return obj


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside it on ``device`` (copies to CUDA are asynchronous:
    truly so from pinned memory, and ordered on the stream either way)."""
    non_blocking = device.type == "cuda"
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))
