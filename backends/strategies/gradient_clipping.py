"""Gradient clipping that works whatever the parameters are: plain tensors, DTensors sharded by
FSDP2 on one mesh, or DTensors of a 2-D ("dp", "tp") mesh beside plain (or 1-D) ones.

``torch.nn.utils.clip_grad_norm_`` refuses a mix ("mixed torch.Tensor and DTensor", or "must
have the same mesh"), and on DTensors it reduces each parameter's norm over the mesh on its own.
Here a gradient with pending sums (a ``Partial`` placement: under sequence parallelism the
norm weights' gradients) is first reduced along those dimensions (``Partial`` becomes
``Replicate``, shards stay shards), so each rank holds its true part. Gradients are then grouped
by mesh and by which mesh dimensions shard them; each group's local ``norm ** p`` is summed on
the rank, then all-reduced once along each sharding dimension (a replicated dimension holds the
same values everywhere and is not summed); the groups' totals make the total norm, and every
gradient (still in its own placement) is scaled by the same factor. With plain tensors alone it
is ``clip_grad_norm_``.

Under pipeline parallelism no placement says that the rest of the model lives on other ranks (each
stage holds its own layers): the caller names the pipeline's process group (``pipeline_group``) and
the rank's total ``norm ** p`` is summed over it (the maximum for the inf norm), so every stage
clips by the norm of the whole model.
"""

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_value_

try:  # public since torch 2.6
    from torch.nn.utils import clip_grads_with_norm_
except ImportError:  # pragma: no cover - older torch
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_ as clip_grads_with_norm_

GroupKey = Tuple[Any, ...]


def settled(gradient: torch.Tensor) -> torch.Tensor:
    """``gradient`` with its pending sums done: a DTensor's ``Partial`` dimensions reduced to
    ``Replicate`` (its ``Shard`` dimensions kept); anything else as it is.

    Example:
        >>> settled(torch.tensor([3.0, 4.0]))
        tensor([3., 4.])
    """
    placements = getattr(gradient, "placements", None)
    if placements is None or not any(placement.is_partial() for placement in placements):
        return gradient
    from torch.distributed.tensor import Replicate

    wanted = [Replicate() if placement.is_partial() else placement for placement in placements]
    with torch.no_grad():
        return gradient.redistribute(gradient.device_mesh, wanted)  # type: ignore[attr-defined]


def _group_key(gradient: torch.Tensor) -> GroupKey:
    """``()`` for a plain tensor; else the mesh and the dimensions that shard the (settled) gradient."""
    mesh = getattr(gradient, "device_mesh", None)
    if mesh is None:
        return ()
    placements = gradient.placements  # type: ignore[attr-defined]
    sharded = tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate())  # settled: no Partial
    return (id(mesh), sharded)


def _group_power(gradients: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The group's ``sum of |g| ** p`` (``max |g|`` for p = inf) over every rank that holds part of it
    (``gradients``: settled, all with the same mesh and sharded dimensions)."""
    first = gradients[0]
    locals_ = [gradient.to_local() if hasattr(gradient, "to_local") else gradient for gradient in gradients]
    norms = torch.stack([torch.linalg.vector_norm(tensor.float(), norm_type) for tensor in locals_])
    infinite = math.isinf(norm_type)
    value = norms.max() if infinite else norms.pow(norm_type).sum()
    if hasattr(first, "device_mesh"):
        for dim, placement in enumerate(first.placements):  # type: ignore[attr-defined]
            if not placement.is_replicate():  # Shard, _StridedShard (FSDP2 over tp): each rank another part
                operation = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
                dist.all_reduce(value, op=operation, group=first.device_mesh.get_group(dim))
    return value


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pipeline_group: Optional[Any] = None
) -> torch.Tensor:
    """The norm of every gradient of ``parameters`` together, as a plain tensor, whatever the
    parameters' meshes (collective for sharded parameters: call it on every rank); with
    ``pipeline_group``, of every stage's gradients together (``parameters``: this stage's).

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2)); weight.grad = torch.tensor([3.0, 4.0])
        >>> float(total_grad_norm([weight]))
        5.0
    """
    groups: Dict[GroupKey, List[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            gradient = settled(parameter.grad)
            groups.setdefault(_group_key(gradient), []).append(gradient)
    infinite = math.isinf(norm_type)
    powers = [_group_power(gradients, norm_type) for gradients in groups.values()]
    if powers:
        device = powers[0].device
        stacked = torch.stack([power.to(device) for power in powers])
        value = stacked.max() if infinite else stacked.sum()
    else:  # a stage without gradients still joins the pipeline's reduction
        value = torch.tensor(0.0)
    if pipeline_group is not None:
        value = value.float().clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=pipeline_group)
    return value if infinite else value.pow(1.0 / norm_type)


def clip_gradients(
    parameters: Iterable[torch.Tensor],
    max_norm: Optional[float] = None,
    max_value: Optional[float] = None,
    pipeline_group: Optional[Any] = None,
) -> Optional[torch.Tensor]:
    """Clip the gradients of ``parameters`` by value (``max_value``) and/or by total 2-norm
    (``max_norm``; ``float("inf")`` measures without clipping). Returns the total norm before
    clipping when ``max_norm`` is given, else None. ``pipeline_group``: the norm is the whole
    pipeline's (``parameters``: this stage's; collective over the group).

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2)); weight.grad = torch.tensor([3.0, 4.0])
        >>> float(clip_gradients([weight], max_norm=1.0)), weight.grad.norm().item() < 1.0 + 1e-6
        (5.0, True)
    """
    parameters = [parameter for parameter in parameters if parameter.grad is not None]
    for parameter in parameters:  # pending sums done once: clamping and scaling act on the true values
        gradient = settled(parameter.grad)  # type: ignore[arg-type]
        if gradient is not parameter.grad:
            parameter.grad = gradient
    if max_value is not None:
        for members in _by_kind(parameters):  # torch's foreach refuses plain and DTensor gradients together
            clip_grad_value_(members, max_value)
    if max_norm is None:
        return None
    plain = not any(hasattr(parameter.grad, "device_mesh") for parameter in parameters)
    if plain and pipeline_group is None:  # plain tensors alone: torch's
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = total_grad_norm(parameters, pipeline_group=pipeline_group)
    if not parameters:
        return total
    for members in _by_kind(parameters):
        clip_grads_with_norm_(members, max_norm, total.to(members[0].grad.device))  # type: ignore[union-attr]
    return total


def _by_kind(parameters: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``parameters`` in groups torch's foreach ops take together: plain gradients, or one mesh and one placement."""
    groups: Dict[GroupKey, List[torch.Tensor]] = {}
    for parameter in parameters:
        grad: Any = parameter.grad
        kind = (id(grad.device_mesh), tuple(grad.placements)) if hasattr(grad, "device_mesh") else ()
        groups.setdefault(kind, []).append(parameter)
    return list(groups.values())
