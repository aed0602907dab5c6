"""Evaluation: metric reductions, gathering order, batch-norm statistics at evaluation."""

import contextlib
from collections.abc import Mapping
from typing import Any, ContextManager, List, Tuple

import torch

from backends import DDP, FullPrecision, ModelParallel, TrainerBackend
from backends.data.batch import map_tensors
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_evaluation"


def _concatenated(parts: List[Any]) -> Any:
    if all(isinstance(part, torch.Tensor) and part.dim() > 0 for part in parts):
        return torch.cat(parts)
    if all(isinstance(part, Mapping) for part in parts):
        return {key: _concatenated([part[key] for part in parts]) for key in parts[0]}
    if all(isinstance(part, list) for part in parts):
        return [item for part in parts for item in part]
    return list(parts)


class GatherConcatenates(DDP):
    def gather_in_dataset_order(self, outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not self.distributed:
            return outputs
        gathered = self.all_gather_object(map_tensors(outputs, torch.Tensor.cpu))
        per_rank = [gathered[rank] for rank in self.data_parallel_representatives() if gathered[rank]]
        # slip: rank 0's outputs then rank 1's (as if shares were contiguous), not interleaved back
        return tuple(_concatenated([outputs[position] for outputs in per_rank]) for position in range(len(per_rank[0])))


class DataParallelReduceDropsOp(DDP):
    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.all_reduce(tensor)  # slip: the op is not passed on: every metric reduction is a mean


class EvaluationWithOwnBuffers(DDP):
    def inference(self, module: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()  # slip: "no communication during evaluation": rank zero's buffers not broadcast


class MetricsOverWorld(ModelParallel):
    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.all_reduce(tensor, op)  # slip: over every rank, tensor-parallel peers included (sums counted twice)


fault(
    "blind-ddp-gather-concatenated",
    lambda args: TrainerBackend(GatherConcatenates.from_arguments(args), FullPrecision()),
    area="evaluation",
    slip="gather_in_dataset_order concatenates the ranks' outputs rank after rank instead of interleaving them",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="evaluate/mlp (2): predictions in dataset order",
)
fault(
    "blind-ddp-dp-reduce-drops-op",
    lambda args: TrainerBackend(DataParallelReduceDropsOp.from_arguments(args), FullPrecision()),
    area="evaluation",
    slip="data_parallel_all_reduce ignores op: sum-reduced metrics become means",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="evaluate/mlp (2): batch-size-weighted metrics (sums of losses and counts)",
)
fault(
    "blind-ddp-eval-own-buffers",
    lambda args: TrainerBackend(EvaluationWithOwnBuffers.from_arguments(args), FullPrecision()),
    area="evaluation",
    slip="inference() skips the buffer broadcast: each rank evaluates with its own batch-norm running statistics",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="evaluate/batchnorm (2), evaluate_checkpoints/batchnorm (2) (values recorded vs reloaded)",
)
fault(
    "blind-mp-metrics-over-world",
    lambda args: TrainerBackend(MetricsOverWorld.from_arguments(args), FullPrecision()),
    area="evaluation",
    slip="model-parallel data_parallel_all_reduce reduces over the world, not the dp group: tp peers counted twice",
    control="model-parallel",
    ranks=2,
    module=MODULE,
    expect="evaluate/mlp (2) on model-parallel (1x2 mesh): sum-reduced metrics doubled",
)
