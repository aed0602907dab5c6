"""Mutants that only inputs chosen to break cancellations show (the ``probes`` cell): a reduce
whose sum is a mean, extremes reduced as means, a clip that ignores the value bound or reports
the norm after clipping, a true-bf16 cast of integer inputs. One fault each."""

from typing import Any, Optional, Sequence, Tuple

import torch

from backends import DDP, FullPrecision, SingleProcess, TrueBF16
from backends.data.batch import map_tensors
from framework.conformance.mutants.library import Kill, backend, register_mutant


class SumIsMean(DDP):
    """The data-parallel "sum" all-reduce returns the mean (weighted means, sum(v*w)/sum(w), still agree)."""

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return super().data_parallel_all_reduce(tensor, "mean" if op == "sum" else op)


class ExtremesAsMean(DDP):
    """Metrics reduced by "max" or "min" are averaged over the ranks instead."""

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return super().data_parallel_all_reduce(tensor, "mean" if op in ("max", "min") else op)


class IgnoresClipValue(DDP):
    """Gradient clipping ignores ``max_value`` (``clip_grad_value``): only the norm is clipped."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        return super().clip_gradients(parameters, max_norm, None)


class PostClipNorm(DDP):
    """Clipping returns the total norm after clipping, not before: the logged ``grad_norm`` is wrong."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        before = super().clip_gradients(parameters, max_norm, max_value)
        if before is None:
            return None
        grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grad) for grad in grads]))


class BF16CastsIntegers(TrueBF16):
    """True bf16 casts every input tensor to bf16, integer ids included (2^24 + 257 reads as 2^24)."""

    def convert_input(self, batch: Any) -> Any:
        return map_tensors(batch, lambda tensor: tensor.to(torch.bfloat16))


def _register(name: str, strategy: Any, kills: Tuple[Kill, ...], kind: str, precision: Any = FullPrecision) -> None:
    doc = (strategy if precision is FullPrecision else precision).__doc__ or ""
    register_mutant(name, backend(strategy, precision), doc.strip().splitlines()[0], kills, kind)


_register("mutant-ddp-sum-is-mean", SumIsMean, (("probes", "mlp", 2),), "evaluation")
_register("mutant-ddp-extremes-as-mean", ExtremesAsMean, (("probes", "mlp", 2),), "evaluation")
_register("mutant-ddp-ignores-clip-value", IgnoresClipValue, (("probes", "mlp", 2),), "clipping")
_register("mutant-ddp-post-clip-norm", PostClipNorm, (("probes", "mlp", 2),), "clipping")
_register("mutant-sp-bf16-casts-integers", SingleProcess, (("probes", "mlp", 1),), "precision", BF16CastsIntegers)
