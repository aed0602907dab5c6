"""Gradient clipping that works whatever the parameters are: plain tensors, DTensors sharded by
FSDP2 on one mesh, or DTensors of a 2-D ("dp", "tp") mesh beside plain (or 1-D) ones.

``torch.nn.utils.clip_grad_norm_`` refuses a mix ("mixed torch.Tensor and DTensor", or "must
have the same mesh"), and on DTensors it reduces each parameter's norm over the mesh on its own.
Here gradients are grouped by mesh and by which mesh dimensions split them; each group's local
``norm ** p`` is summed on the rank, then all-reduced once along each splitting dimension (a
replicated dimension holds the same values everywhere and is not summed); the groups' totals
make the total norm, and every gradient is scaled by the same factor. With plain tensors alone
it is ``clip_grad_norm_``.
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


def _group_key(gradient: torch.Tensor) -> GroupKey:
    """``()`` for a plain tensor; else the mesh and the dimensions that split the gradient."""
    mesh = getattr(gradient, "device_mesh", None)
    if mesh is None:
        return ()
    placements = gradient.placements  # type: ignore[attr-defined]
    split = tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate())
    return (id(mesh), split)


def _local(gradient: torch.Tensor) -> torch.Tensor:
    if not hasattr(gradient, "to_local"):
        return gradient
    if any(placement.is_partial() for placement in gradient.placements):  # type: ignore[attr-defined]
        return gradient.full_tensor()  # type: ignore[attr-defined]  # pending sums: this rank's values are not its part
    return gradient.to_local()


def _group_power(gradients: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The group's ``sum of |g| ** p`` (``max |g|`` for p = inf) over every rank that holds part of it."""
    first = gradients[0]
    locals_ = [_local(gradient) for gradient in gradients]
    norms = torch.stack([torch.linalg.vector_norm(tensor.float(), norm_type) for tensor in locals_])
    infinite = math.isinf(norm_type)
    value = norms.max() if infinite else norms.pow(norm_type).sum()
    if hasattr(first, "device_mesh") and not any(p.is_partial() for p in first.placements):  # type: ignore[attr-defined]
        for dim, placement in enumerate(first.placements):  # type: ignore[attr-defined]
            if not placement.is_replicate():
                operation = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
                dist.all_reduce(value, op=operation, group=first.device_mesh.get_group(dim))
    return value


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient of ``parameters`` together, as a plain tensor, whatever the
    parameters' meshes (collective for sharded parameters: call it on every rank).

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2)); weight.grad = torch.tensor([3.0, 4.0])
        >>> float(total_grad_norm([weight]))
        5.0
    """
    groups = _grouped_parameters(parameters)
    if not groups:
        return torch.tensor(0.0)
    powers = [_group_power([p.grad for p in members], norm_type) for members in groups.values()]  # type: ignore[misc]
    device = powers[0].device
    stacked = torch.stack([power.to(device) for power in powers])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.sum().pow(1.0 / norm_type)


def clip_gradients(
    parameters: Iterable[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
) -> Optional[torch.Tensor]:
    """Clip the gradients of ``parameters`` by value (``max_value``) and/or by total 2-norm
    (``max_norm``; ``float("inf")`` measures without clipping). Returns the total norm before
    clipping when ``max_norm`` is given, else None.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2)); weight.grad = torch.tensor([3.0, 4.0])
        >>> float(clip_gradients([weight], max_norm=1.0)), weight.grad.norm().item() < 1.0 + 1e-6
        (5.0, True)
    """
    parameters = [parameter for parameter in parameters if parameter.grad is not None]
    if max_value is not None:
        clip_grad_value_(parameters, max_value)
    if max_norm is None:
        return None
    groups = _grouped_parameters(parameters)
    if list(groups) == [()]:  # plain tensors alone: exactly torch's
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = total_grad_norm(parameters)
    for members in groups.values():
        clip_grads_with_norm_(members, max_norm, total.to(members[0].grad.device))  # type: ignore[union-attr]
    return total


def _grouped_parameters(parameters: Iterable[torch.Tensor]) -> Dict[GroupKey, List[torch.Tensor]]:
    groups: Dict[GroupKey, List[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            groups.setdefault(_group_key(parameter.grad), []).append(parameter)
    return groups
