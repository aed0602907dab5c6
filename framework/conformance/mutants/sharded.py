"""Mutants of the sharded strategies (FSDP, model-parallel): clipping by the local shards' norm,
and optimizer state taken from the wrong rank on resume. One fault each."""

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from backends import FSDP, FullPrecision, MixedPrecision, ModelParallel
from backends.checkpoint_io import CheckpointIO
from framework.conformance.mutants.library import backend, register_mutant


def _local_norm_clip(parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the norm of this rank's local shards only (no reduction over the ranks)."""
    gradients = [p.grad for p in parameters if p.grad is not None]
    if not gradients:
        return torch.tensor(0.0)
    local = [g.to_local() if hasattr(g, "to_local") else g for g in gradients]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in local]))
    factor = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
    with torch.no_grad():
        for gradient in gradients:
            gradient.mul_(factor)
    return norm


class FSDPLocalNormClip(FSDP):
    """Clips by each rank's local shard norm, not the global norm over every shard."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        if max_value is not None:
            super().clip_gradients(parameters, None, max_value)
        return _local_norm_clip(parameters, max_norm) if max_norm is not None else None


class ModelParallelLocalNormClip(ModelParallel):
    """Clips by each rank's local norm: tensor-parallel shards' norms never summed over the peers."""

    clip_gradients = FSDPLocalNormClip.clip_gradients


class FSDPResumeRankZeroOptimizer(FSDP):
    """On resume every rank gets rank 0's optimizer shard (the optimizer state is broadcast from rank 0)."""

    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        state = super().load_checkpoint(path, io, target, optimizers)
        if target is not None and self.distributed:
            tensors: List[torch.Tensor] = [
                value for optimizer in optimizers for entry in optimizer.state.values() for value in entry.values()
            ]
            _walk(state.get("trainer", state), tensors)
            _from_rank_zero([t for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0], self.all_gather_object)
        return state


def _walk(node: Any, found: List[torch.Tensor], inside: bool = False) -> None:
    if isinstance(node, torch.Tensor):
        if inside:
            found.append(node)
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(value, found, inside or "optim" in str(key))
    elif isinstance(node, (list, tuple)):
        for value in node:
            _walk(value, found, inside)


def _from_rank_zero(tensors: List[torch.Tensor], all_gather_object: Callable[[Any], List[Any]]) -> None:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    shapes = all_gather_object([tuple(t.shape) for t in local])
    if any(len(rank) != len(shapes[0]) for rank in shapes):
        return
    with torch.no_grad():
        for index, tensor in enumerate(local):
            if all(rank[index] == shapes[0][index] for rank in shapes):
                dist.broadcast(tensor, src=0)


def _register(name: str, strategy: Any, kills: Any, kind: str, precision: Any = FullPrecision) -> None:
    register_mutant(name, backend(strategy, precision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-fsdp-local-norm-clip", FSDPLocalNormClip, (("clipping", "mlp", 2),), "clipping")
_register("mutant-model-parallel-local-norm-clip", ModelParallelLocalNormClip, (("clipping", "mlp", 2),), "clipping")
_register("mutant-fsdp-resume-rank0-optimizer", FSDPResumeRankZeroOptimizer, (("resume_kill9", "mlp", 2),), "state")
_register("mutant-fsdp-amp-local-norm-clip", FSDPLocalNormClip, (("clipping", "mlp", 2),), "clipping", MixedPrecision)
