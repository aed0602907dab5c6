"""Model shapes for the layouts only some backends can break, each run where it matters (its
``targets``): a tied embedding split by a tensor-parallel plan, sequence-parallel norms (their
gradients are ``Partial`` DTensors) and a model built on the meta device.

They are outside the covering design (``covered=False``): a tied embedding under ``ddp`` is the
``tied`` shape again. ``python -m framework.conformance BACKEND --models tied-tp`` runs one anywhere.
"""

from typing import Any, Dict, List, Tuple

import torch

from framework.conformance.models import WIDTH, KitNet
from framework.conformance.registry import register_model

VOCABULARY = WIDTH
"""Token ids of the embedding shapes: each input feature bucketed into this many bins."""


def tokens(x: torch.Tensor) -> torch.Tensor:
    """Each feature of ``x`` as a token id in ``[0, VOCABULARY)`` (the same bins on every backend)."""
    boundaries = torch.linspace(-1.5, 1.5, VOCABULARY - 1, device=x.device)
    return torch.bucketize(x.float().contiguous(), boundaries)


@register_model("tied-tp", targets=(("automatic", "model-parallel"),), covered=False)
class WithTiedEmbedding(KitNet):
    """A language model's ends: the input embedding and the output projection one parameter, both
    split by vocabulary rows (``RowwiseParallel`` embedding, ``ColwiseParallel`` head, as
    torchtitan ties them): the split must keep them one parameter."""

    learning_rate = 0.1
    """At 0.2 the tied weight amplifies bf16 rounding: in plain torch under bf16 autocast, the same
    16 samples as two halves end 0.05 (4 quarters: 0.068) from one batch after 16 steps, the
    lower-precision tolerance, so a correct ``ddp-amp`` failed; at 0.1, 0.0074 (0.0042)."""

    def build(self) -> None:
        super().build()
        self.blocks[0] = torch.nn.Linear(WIDTH, WIDTH)
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.unembed = torch.nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.unembed.weight = self.embed.weight

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens(x)).mean(1)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return torch.tanh(self.unembed(h))

    def tensor_parallel_plan(self) -> Dict[str, Any]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "unembed": ColwiseParallel(output_layouts=Replicate()),
        }

    def invariants(self) -> List[Tuple[str, bool, str]]:
        tied = self.unembed.weight is self.embed.weight
        return [("tied embedding", tied, "embed and unembed one parameter" if tied else "the embedding was untied")]


@register_model("sequence-parallel", targets=(("clipping", "model-parallel"),), covered=False)
class WithSequenceParallelNorm(KitNet):
    """torchtitan's sequence parallelism on a 6-token sequence: an embedding whose output is split
    by sequence position, a ``LayerNorm`` under ``SequenceParallel`` (its weights' gradients are
    ``Partial`` DTensors: pending sums over the tensor-parallel ranks), then the blocks split by
    columns and rows."""

    def build(self) -> None:
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)])

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens(x)))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h.mean(1)

    def tensor_parallel_plan(self) -> Dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        return {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "blocks.0": ColwiseParallel(input_layouts=Shard(1)),
            "blocks.1": RowwiseParallel(output_layouts=Replicate()),
        }


@register_model("meta", targets=(("automatic", "model-parallel|fsdp"),), covered=False)
class MetaBuilt(KitNet):
    """The blocks built on the meta device (no memory until each rank's shard is allocated), the
    head built normally: the blocks get the values one process draws from the run's seed."""

    def build(self) -> None:
        with torch.device("meta"):
            super().build()


class Experts(torch.nn.Module):
    """4 experts in an ``nn.ModuleDict`` and an output projection: each sample routed to one expert
    by a feature's value (the rare experts get no sample on some rank in some steps: that rank
    never calls them)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleDict({str(index): torch.nn.Linear(WIDTH, WIDTH) for index in range(4)})

        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        mixed = torch.zeros_like(h)
        for index, expert in self.experts.items():
            chosen = route == int(index)
            if chosen.any():  # an expert no sample chose is not called at all
                mixed = mixed.index_put((chosen,), expert(h[chosen]))
        return self.out(h + mixed)


@register_model("experts", targets=(("automatic", "fsdp"),), covered=False)
class WithUnusedExperts(KitNet):
    """A mixture-of-experts layer between the blocks (as torchtitan's MoE: the experts inside a
    sharding unit): in some steps an expert's parameters are unused on one rank, used on the other."""

    unused_parameters = True

    def tensor_parallel_plan(self) -> Dict[str, Any]:
        """The first block split by columns and gathered whole again; the experts stay whole."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {"blocks.0": ColwiseParallel(output_layouts=Replicate())}

    def build(self) -> None:
        super().build()
        self.blocks[1] = Experts()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        route = torch.bucketize(x[:, 0].float().contiguous(), torch.tensor([-1.0, 0.0, 1.0], device=x.device))
        return torch.tanh(self.blocks[1](h, route))
