"""Mutants only 4 ranks reach: HSDP with two replica groups of two shards, ``model-parallel`` with
two data-parallel rows of two tensor-parallel peers, and ``ddp`` whose resumed first step sums its
gradients in another bucket layout than the run it continues. At 2 ranks the faults are invisible
(one replica group; one row; ``a + b == b + a``), so every 2-rank cell passes on them; the 4-rank
cells (``--ranks 4``, the slow tier: see ``framework/conformance/layouts.py``) kill them."""

from typing import Any, List

import torch
from torch.nn.parallel import DistributedDataParallel

from backends import DDP, FSDP, FullPrecision, ModelParallel
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


class FirstStepLayout(DDP):
    """DDP wrapped as torch builds it: a resumed process reduces its first step in DDP's first-step bucket layout."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        return DistributedDataParallel(module)  # fault: no reduce_in_ready_order, so 4 ranks resume 1e-8 off


def _register(name: str, strategy: Any, kills: Any, kind: str) -> None:
    register_mutant(name, backend(strategy, FullPrecision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-fsdp-hsdp-shard-group-only", ShardGroupOnly, (("automatic", "mlp", 4),), "collectives")
_register("mutant-ddp-first-step-layout", FirstStepLayout, (("resume_kill9", "mlp", 4),), "collectives")
_register("mutant-model-parallel-first-ranks-represent", FirstRanksRepresent, (("evaluate", "mlp", 4),), "evaluation")
