"""CPU copies of a checkpoint's state, made on the training thread so the write can go on in the
background while training changes the originals."""

import collections
from typing import Any, Dict, Optional, Tuple

import torch


def copy_to_cpu(obj: Any, _memo: Optional[Dict[int, torch.Tensor]] = None) -> Any:
    """A copy of ``obj`` whose tensors are fresh CPU tensors (safe to write while training goes on).

    Dicts, lists and tuples are rebuilt, so later in-place changes to the originals do not
    reach the copy; a tensor that appears twice is copied once.

    Example:
        >>> weights = torch.ones(2)
        >>> copy = copy_to_cpu({"w": weights})
        >>> _ = weights.add_(1)
        >>> copy["w"]
        tensor([1., 1.])
    """
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        copied = {key: copy_to_cpu(value, memo) for key, value in obj.items()}
        return collections.OrderedDict(copied) if isinstance(obj, collections.OrderedDict) else copied
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(copy_to_cpu(value, memo) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(value, memo) for value in obj)
    return obj


class StagingBuffers:
    """CPU copies of a state for asynchronous saves, reusing the previous save's buffers.

    Reusing buffers of the same shape and dtype avoids allocating (and page-faulting) the
    whole checkpoint again at every save; buffers are pinned when the source is on a GPU,
    so the device-to-host copies run asynchronously and are awaited once. Only safe when
    the write of the previous copy has finished (the checkpointer waits for it first).

    Example:
        >>> staging = StagingBuffers()
        >>> weights = torch.ones(2)
        >>> first = staging.copy({"w": weights})
        >>> second = staging.copy({"w": weights * 2})
        >>> second["w"].data_ptr() == first["w"].data_ptr(), second["w"]
        (True, tensor([2., 2.]))
    """

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        """``obj`` with every tensor copied into a CPU buffer (containers rebuilt)."""
        used: Dict[Tuple[Any, ...], torch.Tensor] = {}
        memo: Dict[int, torch.Tensor] = {}
        result = self._copy(obj, (), used, memo)
        self._buffers = used
        if any(buffer.is_pinned() for buffer in used.values()):
            torch.cuda.synchronize()
        return result

    def _copy(
        self, obj: Any, path: Tuple[Any, ...], used: Dict[Tuple[Any, ...], torch.Tensor], memo: Dict[int, torch.Tensor]
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo:
                return memo[id(obj)]
            source = obj.detach()
            if source.layout != torch.strided or source.is_quantized or type(source) is not torch.Tensor:
                copied = source.to("cpu", copy=True)
            else:
                buffer = self._buffers.get(path)
                if (
                    buffer is None
                    or buffer.shape != source.shape
                    or buffer.dtype != source.dtype
                    or buffer.stride() != source.stride()
                ):
                    pin = source.is_cuda and torch.cuda.is_available()
                    buffer = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, pin_memory=pin)
                buffer.copy_(source, non_blocking=source.is_cuda)
                used[path] = copied = buffer
            memo[id(obj)] = copied
            return copied
        if isinstance(obj, dict):
            copied_dict = {key: self._copy(value, (*path, key), used, memo) for key, value in obj.items()}
            return collections.OrderedDict(copied_dict) if isinstance(obj, collections.OrderedDict) else copied_dict
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self._copy(value, (*path, index), used, memo) for index, value in enumerate(obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, (*path, index), used, memo) for index, value in enumerate(obj))
        return obj
