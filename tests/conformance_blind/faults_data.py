"""Data: samplers, data-parallel shares, resume positions, stream sharding (DDP subclasses and samplers)."""

from typing import Any, Callable, Iterator, Optional, Sized, Type

import torch

from backends import DDP, FullPrecision, ResumableSampler, TrainerBackend
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_data"


def on_ddp(strategy: Type[DDP]) -> Callable[[Any], TrainerBackend]:
    return lambda args: TrainerBackend(strategy.from_arguments(args), FullPrecision())


class NoPaddingForTraining(DDP):
    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        # slip: "padding repeats samples and biases the epoch": never pad, also for training
        return ResumableSampler(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=False
        )


class EvaluationPadded(DDP):
    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        # slip: "pad so every rank has as many batches and nobody waits": evaluation samples repeated
        return ResumableSampler(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=True
        )


class PerRankShuffleSeed(DDP):
    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        # slip: "each rank its own shuffle": the seed offset by the rank, so the shares overlap
        return super().create_sampler(dataset, shuffle, seed + self.rank, pad)


class ContiguousSampler(ResumableSampler):
    def __iter__(self) -> Iterator[int]:
        # slip: shares are contiguous blocks (rank r takes [r * n, (r + 1) * n)), not positions r, r + W, ...
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_size))
        if self.pad and self.dataset_size % self.world_size:
            missing = self.world_size - self.dataset_size % self.world_size
            indices += (indices * (missing // max(len(indices), 1) + 1))[:missing]
        sizes = [len(range(rank, len(indices), self.world_size)) for rank in range(self.world_size)]
        start = sum(sizes[: self.rank])
        shard = indices[start : start + sizes[self.rank]]
        self._iterator, self._shard_end = iter(shard[self.skip :]), len(shard)
        return self._iterator


class ContiguousShares(DDP):
    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        return ContiguousSampler(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=pad
        )


class GlobalCountSampler(ResumableSampler):
    def fast_forward(self, num_indices: int) -> None:
        # slip: reads the count as global (every rank's samples) and divides it over the ranks
        super().fast_forward(num_indices // self.world_size)


class FastForwardGlobal(DDP):
    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        return GlobalCountSampler(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=pad
        )


class StreamNotSharded(DDP):
    def prepare_loader(self, loader: Any) -> Any:
        return loader  # slip: "the DataLoader's sampler shards already": streams read whole on every rank


fault(
    "blind-ddp-no-pad-train",
    on_ddp(NoPaddingForTraining),
    area="data",
    slip="create_sampler never pads (pad=False for training too): uneven shares, the tail of an epoch dropped",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic (a dataset size not divisible by the world size), workers",
)
fault(
    "blind-ddp-eval-padded",
    on_ddp(EvaluationPadded),
    area="data",
    slip="create_sampler always pads (pad=True for evaluation too): a sample evaluated twice, 22 outputs for 21",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="evaluate/mlp (2): 21 samples, uneven shares",
)
fault(
    "blind-ddp-per-rank-shuffle-seed",
    on_ddp(PerRankShuffleSeed),
    area="data",
    slip="create_sampler seeds each rank's shuffle with seed + rank: shares overlap, some samples never seen",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic/mlp (2)",
)
fault(
    "blind-ddp-contiguous-shares",
    on_ddp(ContiguousShares),
    area="data",
    slip="the sampler's __iter__ deals contiguous blocks instead of round-robin positions (other batches, other order)",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="automatic/mlp (2) (other micro-batches), evaluate/mlp (2) (dataset order)",
)
fault(
    "blind-ddp-fast-forward-global",
    on_ddp(FastForwardGlobal),
    area="data",
    slip="the sampler's fast_forward divides the count by the world size (read as global): a resumed epoch replays",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="resume_kill9/mlp (2), resume_signal (2)",
)
fault(
    "blind-ddp-stream-unsharded",
    on_ddp(StreamNotSharded),
    area="data",
    slip="prepare_loader returns the loader as it is: an IterableDataset is read whole by every rank",
    control="ddp",
    ranks=2,
    module=MODULE,
    expect="streams/mlp (2)",
)
