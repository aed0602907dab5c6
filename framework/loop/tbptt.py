"""Truncated backprop through time: splitting a batch into chunks along the time dimension."""

from typing import Any, Iterable, List, Optional

import torch


def split_along_time(batch: Any, chunk_length: int) -> List[Any]:
    """Split every tensor of ``batch`` with 2+ dims along dim 1 into chunks of ``chunk_length``.

    Tuples, lists and dicts are split element-wise; other values are repeated in every chunk.

    Example:
        >>> [c[0].shape[1] for c in split_along_time((torch.zeros(2, 5, 3), torch.zeros(2, 5)), 2)]
        [2, 2, 1]
    """
    chunks = _split(batch, chunk_length)
    if chunks is None:
        raise ValueError(
            f"tbptt_steps={chunk_length} needs a tensor with 2+ dims (batch, time, ...) in the batch; "
            f"got a batch of type {type(batch).__name__} with none"
        )
    return chunks


def _split(batch: Any, chunk_length: int) -> Optional[List[Any]]:
    """The chunks of ``batch``, or None when nothing in it has a time dimension."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(chunk_length, dim=1)) if batch.dim() >= 2 else None
    if isinstance(batch, dict):
        by_key = {key: _split(value, chunk_length) for key, value in batch.items()}
        if all(value is None for value in by_key.values()):
            return None
        count = _chunk_count(by_key.values())
        return [{key: value[i] if value is not None else batch[key] for key, value in by_key.items()} for i in range(count)]
    if isinstance(batch, (list, tuple)):
        parts = [_split(value, chunk_length) for value in batch]
        if all(part is None for part in parts):
            return None
        count = _chunk_count(parts)
        return [type(batch)(p[i] if p is not None else v for p, v in zip(parts, batch)) for i in range(count)]
    return None


def _chunk_count(parts: Iterable[Optional[List[Any]]]) -> int:
    counts = {len(p) for p in parts if p is not None}
    if len(counts) != 1:
        raise ValueError(
            f"tbptt_steps needs every tensor with 2+ dims to share dim 1's length; got chunk counts {sorted(counts)}"
        )
    return counts.pop()
