"""Clipping: the norm returned, clip-by-value, sharded norms."""

from typing import Optional, Sequence

import torch
from torch.nn.utils import clip_grad_value_

from backends import DDP, FSDP, FullPrecision, TrainerBackend
from backends.strategies.gradient_clipping import total_grad_norm
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_clipping"


class NormAfterClipping(DDP):
    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        parameters = list(parameters)
        super().clip_gradients(parameters, max_norm, max_value)
        return None if max_norm is None else total_grad_norm(parameters)  # slip: the norm measured after clipping


class ClipValueIgnored(DDP):
    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        return super().clip_gradients(parameters, max_norm)  # slip: max_value not passed on


class MeanOfRankNorms(FSDP):
    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        parameters = [parameter for parameter in parameters if parameter.grad is not None]
        if max_value is not None:
            for parameter in parameters:
                clip_grad_value_([parameter], max_value)
        if max_norm is None or not parameters:
            return None
        local = [getattr(p.grad, "_local_tensor", p.grad) for p in parameters]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in local]))
        norm = self.all_reduce(norm, "mean")  # slip: the ranks' shard norms averaged, not sqrt(sum of squares)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for parameter in parameters:
            parameter.grad.mul_(coefficient.item())  # type: ignore[union-attr]
        return norm


fault(
    "blind-ddp-clip-returns-post-norm",
    lambda args: TrainerBackend(NormAfterClipping.from_arguments(args), FullPrecision()),
    area="clipping",
    slip="clip_gradients returns the total norm measured after clipping (<= max_norm), not before",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="clipping/mlp (2) or manual (the logged grad_norm / clip_gradients' return value)",
)
fault(
    "blind-ddp-clip-value-ignored",
    lambda args: TrainerBackend(ClipValueIgnored.from_arguments(args), FullPrecision()),
    area="clipping",
    slip="clip_gradients drops max_value: clip-by-value (max_grad_value / clip_gradients(max_value=)) does nothing",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="clipping or manual, if either clips by value",
)
fault(
    "blind-fsdp-clip-mean-of-rank-norms",
    lambda args: TrainerBackend(MeanOfRankNorms.from_arguments(args), FullPrecision()),
    area="clipping",
    slip="clip_gradients averages the ranks' local shard norms instead of sqrt(sum of squares): too small a norm",
    control="fsdp",
    ranks=2,
    module=MODULE,
    expect="clipping/mlp (2) on fsdp",
)
