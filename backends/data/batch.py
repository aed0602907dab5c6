"""Nested batches: applying a function to every tensor inside any common container."""

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with ``fn(tensor)`` in place of every tensor inside it.

    Rebuilt: every ``Mapping`` (``dict``, ``OrderedDict``, ``defaultdict`` with its default
    factory, ``UserDict``, ...), tuples (named tuples included), lists and dataclass
    instances (a shallow copy with its fields replaced; ``init=False`` fields too). Anything
    else is returned unchanged. The input is never modified.

    Example:
        >>> map_tensors({"x": torch.ones(2), "n": 3}, lambda t: t * 2)
        {'x': tensor([2., 2.]), 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = [(key, map_tensors(value, fn)) for key, value in obj.items()]
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, items)
        if type(obj) is dict or not isinstance(obj, MutableMapping):
            mapping_class: Any = type(obj)  # a concrete Mapping subclass; built from pairs
            try:
                return mapping_class(items)
            except TypeError:  # a read-only mapping that cannot be built from pairs
                return dict(items)
        rebuilt = copy.copy(obj)  # keeps the class and its attributes (UserDict, custom mappings)
        for key, value in items:
            rebuilt[key] = value
        return rebuilt
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(value, fn) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(value, fn) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        instance = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(instance, field.name, map_tensors(getattr(obj, field.name), fn))  # frozen ones too
        return instance
    return obj


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside it on ``device`` (copies to CUDA are asynchronous:
    truly so from pinned memory, and ordered on the stream either way)."""
    non_blocking = device.type == "cuda"
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))
