"""Moving nested batches (tensors inside tuples, lists and dicts) to a device."""

from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor inside it moved to ``device``.

    Tuples (named tuples included), lists and dicts are rebuilt; anything else is
    returned unchanged. Copies from pinned memory to CUDA are asynchronous.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return type(batch)((key, move_to_device(value, device)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(value, device) for value in batch)
    return batch
