"""Mutants of the 2-D meshes only 4 ranks reach: HSDP with two replica groups of two shards, and
``model-parallel`` with two data-parallel rows of two tensor-parallel peers. At 2 ranks both
faults are invisible (one replica group; one row), so every 2-rank cell passes on them; the 4-rank
cells (``--ranks 4``, the slow tier: see ``framework/conformance/layouts.py``) kill them."""

from typing import Any, List

import torch

from backends import FSDP, FullPrecision, ModelParallel
from backends.strategies.hsdp import SHARD_DIM, hsdp_mesh
from framework.conformance.mutants.library import backend, register_mutant


class ShardGroupOnly(FSDP):
    """HSDP shards and reduces over the shard group only: gradients are never all-reduced across the replica groups."""

    def sharding_mesh(self, module: torch.nn.Module) -> Any:
        if (replicas := self.data_parallel_replicate_size) > 1:
            mesh = hsdp_mesh(self.device.type, replicas, self.world_size // replicas)
            return mesh[SHARD_DIM]  # fault: the 1-D shard mesh, so each replica group trains on its own data
        return super().sharding_mesh(module)


class FirstRanksRepresent(ModelParallel):
    """The ranks speaking for the data-parallel rows in gathers are the first ``data_parallel_size``, not each row's first."""

    def data_parallel_representatives(self) -> List[int]:
        return list(range(self.data_parallel_size))  # fault: rank 1 is row 0's tensor-parallel peer, not row 1


def _register(name: str, strategy: Any, kills: Any, kind: str) -> None:
    register_mutant(name, backend(strategy, FullPrecision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-fsdp-hsdp-shard-group-only", ShardGroupOnly, (("automatic", "mlp", 4),), "collectives")
_register("mutant-model-parallel-first-ranks-represent", FirstRanksRepresent, (("evaluate", "mlp", 4),), "evaluation")
