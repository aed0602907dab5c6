"""Mutants that break a data promise: the seed, the epoch, the resume position, and which rank
reads which share (data-parallel rank, tensor-parallel peers). One fault each."""

from typing import Any, Dict, List, Optional, Sized

from backends import DDP, FullPrecision, ModelParallel
from backends.data.samplers import ResumableSampler
from framework.conformance.mutants.library import backend, register_mutant


class EpochForgettingSampler(ResumableSampler):
    """``set_epoch`` resets the position but keeps epoch 0's order."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(0)


class PositionForgettingSampler(ResumableSampler):
    """``fast_forward`` and ``load_state_dict`` ignore the position: a resumed epoch starts over."""

    def fast_forward(self, num_indices: int) -> None:
        super().fast_forward(0)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict({**state, "skip": 0})


class SeedlessSampler(DDP):
    """The sampler ignores ``TrainerArguments.seed`` (always shuffles with seed 0)."""

    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        return super().create_sampler(dataset, shuffle, 0, pad)


class EpochForgetting(DDP):
    """The sampler's ``set_epoch`` forgets the epoch: every epoch repeats the first one's order."""

    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        rank, size = self.data_parallel_rank, self.data_parallel_size
        return EpochForgettingSampler(dataset, shuffle=shuffle, seed=seed, rank=rank, world_size=size, pad=pad)


class PositionForgetting(DDP):
    """The sampler forgets its position on resume: a run resumed mid-epoch replays the epoch from its start."""

    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        rank, size = self.data_parallel_rank, self.data_parallel_size
        return PositionForgettingSampler(dataset, shuffle=shuffle, seed=seed, rank=rank, world_size=size, pad=pad)


class TensorPeersDiffer(ModelParallel):
    """Samplers split the data by global rank: tensor-parallel peers read different samples."""

    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        return ResumableSampler(dataset, shuffle=shuffle, seed=seed, rank=self.rank, world_size=self.world_size, pad=pad)


class RankAsDataParallelRank(ModelParallel):
    """``data_parallel_rank`` is the global rank (the data-parallel size is right): a rank past it fails, its peer waits."""

    @property
    def data_parallel_rank(self) -> int:
        return self.rank


class EveryRankRepresents(ModelParallel):
    """Every rank speaks for a share of the data in gathers: tensor-parallel peers' outputs are counted twice."""

    def data_parallel_representatives(self) -> List[int]:
        return list(range(self.world_size))


def _register(name: str, strategy: Any, kills: Any, kind: str) -> None:
    register_mutant(name, backend(strategy, FullPrecision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-ddp-seedless-sampler", SeedlessSampler, (("automatic", "mlp", 2),), "data")
_register("mutant-ddp-epoch-forgetting-sampler", EpochForgetting, (("automatic", "mlp", 2),), "data")
_register("mutant-ddp-position-forgetting-sampler", PositionForgetting, (("resume_kill9", "mlp", 2),), "state")
_register("mutant-model-parallel-tp-peers-differ", TensorPeersDiffer, (("automatic", "mlp", 2),), "data")
_register("mutant-model-parallel-rank-as-dp-rank", RankAsDataParallelRank, (("automatic", "mlp", 2),), "data")
_register("mutant-model-parallel-every-rank-represents", EveryRankRepresents, (("evaluate", "mlp", 2),), "evaluation")
