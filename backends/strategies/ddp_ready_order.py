"""DDP's first step reduced in the bucket layout of every later step, so a resumed run on more than
two ranks is bitwise the run it continues.

``DistributedDataParallel`` reduces its first backward in one bucket that holds every
parameter in module order. At the next forward it rebuilds its buckets in the order the
gradients became ready (the last layer first) and keeps that layout from then on. On more
than two ranks, the sum of one gradient element depends on where the element sits in its
bucket: a ring all-reduce (gloo's, NCCL's) sums each chunk of the flat buffer starting from
another rank, so the same four numbers are added in another order. A resumed process starts
a new reducer, whose first step is reduced in the first-step layout where the uninterrupted
run used the rebuilt one: the runs part by about 1e-8 at the step after the resume. With
two ranks ``a + b == b + a`` and the layout does not matter.

:func:`reduce_in_ready_order` registers a comm hook that reduces the first backward in the
buckets the rebuild will make (the ready order, cut by DDP's own bucket caps), and every
later bucket as DDP's default hook does (divide by the world size, all-reduce the sum).
Every step of every process, resumed or not, is then summed in one layout.

The hook is registered at the first forward, and only when no other comm hook has been: a
backend that registers its own hook in ``wrap_module`` (compression, counting, a built-in one;
see docs/backends.md) keeps it, and its resumes are exact on more than two ranks only when its
hook does not depend on the layout. Its cost: a Python call per bucket and one pass over the
gradients per step (the division by the world size; docs/distributed.md has the figures).
"""

import logging
from typing import Any, List, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)


def reduce_in_ready_order(wrapped: DistributedDataParallel) -> None:
    """Reduce every step of ``wrapped`` in the bucket layout DDP rebuilds after its first step.

    Nothing is registered where the layout cannot matter (two ranks or fewer) or never changes
    (``find_unused_parameters=True``: DDP does not rebuild its buckets then). Otherwise the hook
    is registered at the first forward, unless a comm hook is registered by then.
    :class:`~backends.strategies.ddp.DDP` calls it on every module it wraps.
    """
    if wrapped.find_unused_parameters or dist.get_world_size(wrapped.process_group) <= 2:
        return
    pending: List[Any] = []

    def register_at_first_forward(module: torch.nn.Module, inputs: Any) -> None:
        pending.pop().remove()
        if not wrapped._get_ddp_logging_data().get("comm_hook"):  # else the backend registered its own (or a built-in)
            wrapped.register_comm_hook(_ReadyOrder(wrapped), _reduce_bucket)

    pending.append(wrapped.register_forward_pre_hook(register_at_first_forward))


class _ReadyOrder:
    """The comm hook's state: the order this process's first backward produced its gradients."""

    def __init__(self, wrapped: DistributedDataParallel) -> None:
        self.group = wrapped.process_group
        self.bucket_caps = _rebuild_bucket_caps(wrapped)
        self.ready: List[torch.nn.Parameter] = []
        self.first_step_done = False
        self.handles = [
            parameter.register_post_accumulate_grad_hook(self.ready.append)
            for parameter in wrapped.module.parameters()
            if parameter.requires_grad
        ]

    def reduce_first_step(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """All-reduce the one first-step bucket in the buckets DDP's rebuild will make."""
        for handle in self.handles:
            handle.remove()
        parameters = bucket.parameters()
        position = {id(parameter): index for index, parameter in enumerate(parameters)}
        reduced = [position[id(parameter)] for parameter in self.ready if id(parameter) in position]  # not DDP's ignored
        ready = reduced[-len(parameters) :]  # the last backward's (no_sync micro-batches came before it)
        self.ready.clear()
        if sorted(ready) != list(range(len(parameters))):  # a parameter reached twice or not at all: no order to follow
            logger.debug("ddp: the first backward's ready order is incomplete; its bucket is reduced as one")
            return _all_reduce(bucket.buffer(), self.group)
        groups, _ = dist._compute_bucket_assignment_by_size(
            [parameters[index] for index in ready], self.bucket_caps, [False] * len(ready), ready
        )
        gradients = bucket.gradients()  # views of the bucket's buffer
        flats = [torch.cat([gradients[index].reshape(-1) for index in group]) for group in groups]
        reductions = [_all_reduce(flat, self.group) for flat in flats]

        def write_back(_: Any) -> torch.Tensor:
            for group, flat in zip(groups, flats):
                _unflatten_into([gradients[index] for index in group], flat)
            return bucket.buffer()

        return torch.futures.collect_all(reductions).then(write_back)


def _reduce_bucket(state: _ReadyOrder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: the first backward's single bucket in the rebuilt layout, then as DDP's default."""
    bucket.buffer().div_(dist.get_world_size(state.group))
    if not state.first_step_done:
        state.first_step_done = True
        if bucket.index() == 0 and bucket.is_last():  # the first-step layout: one bucket
            return state.reduce_first_step(bucket)
    return _all_reduce(bucket.buffer(), state.group)


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def _unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _rebuild_bucket_caps(wrapped: DistributedDataParallel) -> List[int]:
    """The bucket size limits DDP's rebuild uses: a smaller first bucket, then ``bucket_cap_mb``."""
    config = getattr(wrapped, "_bucket_config", None)  # newer torch; older ones always cap the first bucket at 1 MiB
    first = config.first_bucket_bytes_cap if config is not None else dist._DEFAULT_FIRST_BUCKET_BYTES
    return [first, wrapped.bucket_bytes_cap]
