"""The model shapes real users have, as conformance models: each cell of the matrix trains one.

Every shape keeps :class:`~framework.conformance.models.KitNet`'s data, steps and head and
changes only the body: buffers (float, integer, complex), tied weights (beside and across the
blocks), frozen weights, batch norm,
blocks in an ``nn.ModuleDict``, and an initialisation that differs on every rank. A new shape
joins the matrix with ``@register_model("name")``.
"""

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from framework.conformance.models import FEATURES, WIDTH, KitNet
from framework.conformance.registry import register_model

register_model("mlp", quick=True)(KitNet)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _whole_between_blocks(self: KitNet) -> Dict[str, Any]:
    """A tensor-parallel plan for a shape that works on whole features between its blocks: the
    second block split by columns, its output gathered whole again."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"blocks.1": ColwiseParallel(output_layouts=Replicate())}


@register_model("buffers", quick=True)
class WithBuffers(KitNet):
    """A rotary cos/sin cache (float buffers of several elements) and a permutation (an integer
    buffer), built differently on every rank but zero (as a buffer computed from the rank, or
    from an unseeded generator): only a backend that gives every rank rank zero's buffers
    trains as ``sp``."""

    cos: torch.Tensor
    sin: torch.Tensor
    order: torch.Tensor

    tensor_parallel_plan = _whole_between_blocks

    def build(self) -> None:
        super().build()
        angles = torch.arange(WIDTH, dtype=torch.float32) / WIDTH * math.pi
        self.register_buffer("cos", torch.cos(angles))
        self.register_buffer("sin", torch.sin(angles))
        self.register_buffer("order", torch.arange(WIDTH - 1, -1, -1))
        rank = _rank()
        if rank:  # every rank but zero starts from buffers of its own: a backend must give it rank zero's
            with torch.no_grad():
                self.cos.add_(0.25 * rank)
                self.sin.mul_(1.0 + 0.5 * rank)
            self.order = torch.roll(self.order, rank)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        h = h * self.cos.to(h.dtype) + h[:, self.order] * self.sin.to(h.dtype)
        return torch.tanh(self.blocks[1](h))


@register_model("complex")
class WithComplexBuffer(KitNet):
    """A rotary table ``freqs_cis`` (complex64), applied as in torchtitan's llama."""

    freqs_cis: torch.Tensor

    tensor_parallel_plan = _whole_between_blocks

    def build(self) -> None:
        super().build()
        angles = torch.arange(WIDTH // 2, dtype=torch.float32) + 0.5
        self.register_buffer("freqs_cis", torch.polar(torch.ones(WIDTH // 2), angles))

    def invariants(self) -> List[Tuple[str, bool, str]]:
        kind = self.freqs_cis.dtype
        return [("complex buffer", kind.is_complex, f"freqs_cis is {str(kind).replace('torch.', '')} after training")]

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        rotated = torch.view_as_complex(h.float().reshape(len(h), WIDTH // 2, 2)) * self.freqs_cis
        h = torch.view_as_real(rotated).reshape(len(h), WIDTH).to(h.dtype)
        return torch.tanh(self.blocks[1](h))


@register_model("tied")
class WithTiedWeights(KitNet):
    """Two projections outside the blocks sharing one weight (as a language model ties its
    embedding and output), the blocks between them."""

    tensor_parallel_plan = _whole_between_blocks

    def build(self) -> None:
        super().build()
        self.project_in = torch.nn.Linear(WIDTH, WIDTH)
        self.project_out = torch.nn.Linear(WIDTH, WIDTH)
        self.project_out.weight = self.project_in.weight

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.project_in(torch.tanh(self.blocks[0](x))))
        return torch.tanh(self.project_out(torch.tanh(self.blocks[1](h))))


@register_model("tied-blocks")
class WithTiedBlocks(KitNet):
    """Two blocks sharing one weight (as ALBERT shares its layers): two sharding units holding
    one parameter. The tensor-parallel plan splits only the first block, so the tie stays whole."""

    expected_units = 3

    def build(self) -> None:
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Linear(FEATURES, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)]
        )
        self.blocks[2].weight = self.blocks[1].weight

    def invariants(self) -> List[Tuple[str, bool, str]]:
        tied = self.blocks[2].weight is self.blocks[1].weight
        return [("tied blocks", tied, "blocks 1 and 2 share one weight" if tied else "the tie was broken")]

    def tensor_parallel_plan(self) -> Dict[str, Any]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {"blocks.0": ColwiseParallel(output_layouts=Replicate())}


@register_model("frozen")
class WithFrozenParameters(KitNet):
    """The first block frozen (``requires_grad=False``), as in fine-tuning."""

    def build(self) -> None:
        super().build()
        self.blocks[0].requires_grad_(False)


@register_model("batchnorm", targets=(("resume_kill9", "fsdp"),), covered=True)  # one truth for buffers at 2 ranks
class WithBatchNorm(KitNet):
    """A ``BatchNorm1d`` inside the first block (running statistics: float and integer buffers).

    Compared with ``sp`` on 1 rank only: data-parallel batch norm normalises each rank's
    micro-batch (and keeps each rank's running statistics), so on several ranks it computes
    something else than ``sp`` by design; ``nn.SyncBatchNorm`` is the model-side answer. On 2
    ranks it runs the features that compare a backend with itself (a resume against the same
    backend's uninterrupted run): what is saved must be what trains on.
    """

    ranks = (1,)

    tensor_parallel_plan = _whole_between_blocks

    def build(self) -> None:
        norm = torch.nn.Sequential(torch.nn.Linear(FEATURES, WIDTH), torch.nn.BatchNorm1d(WIDTH))
        self.blocks = torch.nn.ModuleList([norm, torch.nn.Linear(WIDTH, WIDTH)])


@register_model("moduledict")
class WithModuleDict(KitNet):
    """Blocks kept in an ``nn.ModuleDict`` (as torchtitan keeps its layers)."""

    def build(self) -> None:
        self.blocks = torch.nn.ModuleDict(  # type: ignore[assignment]
            {"0": torch.nn.Linear(FEATURES, WIDTH), "1": torch.nn.Linear(WIDTH, WIDTH)}
        )

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():  # type: ignore[operator]
            x = torch.tanh(block(x))
        return x


@register_model("per_rank_init")
class PerRankInit(KitNet):
    """Initialised from the rank (as a program that seeds by rank, or not at all): only a
    backend that starts every rank from rank zero's weights trains as ``sp``."""

    def build(self) -> None:
        super().build()
        rank = _rank()
        generator = torch.Generator().manual_seed(1234 + 7919 * rank)
        with torch.no_grad():
            for parameter in self.blocks.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
