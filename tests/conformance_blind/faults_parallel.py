"""Model parallel (tp/dp ranks) and HSDP (replicate vs shard groups)."""

from typing import Any

from backends import FullPrecision, ModelParallel, TrainerBackend
from backends.data.streams import shard_stream
from tests.conformance_blind import fault
from tests.conformance_blind.controls import HybridFSDP, hsdp_backend

MODULE = "tests.conformance_blind.faults_parallel"


class StreamByGlobalRank(ModelParallel):
    def prepare_loader(self, loader: Any) -> Any:
        return shard_stream(loader, self.rank, self.world_size)  # slip: global rank: tp peers read different samples


class ShardDimensionOnly(HybridFSDP):
    def sharding_mesh(self, module: Any) -> Any:
        mesh = super().sharding_mesh(module)
        # slip: "fully_shard wants the shard dimension": the replicate dimension dropped, no all-reduce across groups
        return mesh["dp_shard"] if self.data_parallel_replicate_size > 1 else mesh


class ShardIndexAsDataRank(HybridFSDP):
    @property
    def data_parallel_rank(self) -> int:  # slip: the position inside the replica group taken as the data rank
        return self.rank % (self.world_size // self.data_parallel_replicate_size)

    @property
    def data_parallel_size(self) -> int:  # ... and the group's size as the number of shares
        return self.world_size // self.data_parallel_replicate_size


fault(
    "blind-mp-stream-by-global-rank",
    lambda args: TrainerBackend(StreamByGlobalRank.from_arguments(args), FullPrecision()),
    area="model-parallel",
    slip="prepare_loader shards streams by global rank and world size, not by data-parallel rank and size",
    control="model-parallel",
    ranks=2,
    module=MODULE,
    expect="streams/mlp (2) on model-parallel (tp peers must read identical batches)",
)
fault(
    "blind-hsdp-shard-dim-only",
    lambda args: hsdp_backend(args, ShardDimensionOnly),
    area="hsdp",
    slip="sharding_mesh returns mesh['dp_shard'] only: gradients are never all-reduced across replica groups",
    control="blind-ctl-hsdp (fsdp)",
    ranks=2,
    module=MODULE,
    expect="automatic/mlp (2): ranks differ",
)
fault(
    "blind-hsdp-shard-index-as-dp-rank",
    lambda args: hsdp_backend(args, ShardIndexAsDataRank),
    area="hsdp",
    slip="data_parallel_rank/size taken from the shard group (rank % shard size, shard size): replicas read the same data",
    control="blind-ctl-hsdp (fsdp)",
    ranks=2,
    module=MODULE,
    expect="evaluate/mlp (2) (each sample gathered twice); automatic (same gradients, so it may pass)",
)
