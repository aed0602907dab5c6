"""The DTensor helpers of the sharding strategies: what a rank holds of a tensor, and the whole tensor."""

from typing import Dict

import torch


def is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().cpu() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def sharded_parameter_count(module: torch.nn.Module) -> Dict[str, int]:
    """``{"local": elements this rank holds, "total": elements of the full model}``.

    Example:
        >>> sharded_parameter_count(torch.nn.Linear(2, 2))
        {'local': 6, 'total': 6}
    """
    local = total = 0
    for parameter in module.parameters():
        total += parameter.numel()
        local += local_tensor(parameter).numel()
    return {"local": local, "total": total}
