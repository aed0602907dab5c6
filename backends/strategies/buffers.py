"""One value per buffer across data-parallel ranks: rank zero's (batch norm's running statistics).

Each rank updates its buffers from its own batches. DDP (``broadcast_buffers``) gives every rank
rank zero's buffers at the first forward after a synchronised backward; between those forwards
the ranks hold their own. The strategies make evaluation and checkpoints see the same values:
:func:`broadcast_buffers` before each evaluation (every rank evaluates rank zero's buffers) and
before each sharded save (DCP writes one rank's copy of a replicated tensor, not always rank
zero's), and :class:`BufferBroadcast` gives ``fsdp`` DDP's rule during training.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist

_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast bucket


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank zero's buffers of ``module``, in place, in as few broadcasts as DDP's
    ``broadcast_buffers`` (collective over every rank). Buffers split by tensor parallelism
    (DTensors) are left alone.

    Example:
        >>> broadcast_buffers(torch.nn.BatchNorm1d(2))  # one process: nothing to do
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.tensor import DTensor

    tensors = [
        torch.view_as_real(buffer.data) if buffer.is_complex() else buffer.data
        for buffer in module.buffers()
        if not isinstance(buffer, DTensor)
    ]
    if tensors:
        dist._broadcast_coalesced(dist.distributed_c10d._get_default_group(), tensors, _BUCKET_BYTES, 0)


class BufferBroadcast:
    """DDP's buffer rule on a module no DDP wraps (the ``fsdp`` root): rank zero's buffers are
    broadcast before a training forward that follows a synchronised one (the first micro-batch
    of each optimizer step), never before the others (whose gradients skip the sync).

    Example:
        >>> rule = BufferBroadcast(torch.nn.BatchNorm1d(2))  # one process: the broadcasts do nothing
        >>> rule.gradient_sync = False  # inside no_sync
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.gradient_sync = True  # False inside the strategy's no_sync
        self._due = True  # as DDP's require_forward_param_sync: True until a forward without sync
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and self._due:
            broadcast_buffers(module)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Optional[Any]:
        if torch.is_grad_enabled():
            self._due = self.gradient_sync
        return None
