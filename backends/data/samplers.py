"""The one sampler every built-in strategy hands out: seeded, sharded, resumable."""

import operator
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sized, Tuple

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Yields this rank's share of a dataset's indices, in an order fixed by seed and epoch.

    Training shuffles with a generator seeded from ``seed + epoch``: every epoch has a new
    order, every run (and every rank) the same one. Under several ranks the index list is
    padded by repeating its head so each rank gets the same count (no rank waits for
    another at the end of an epoch), then dealt out round-robin: rank ``r`` gets positions
    ``r, r + world_size, ...``. Evaluation keeps dataset order and does not pad, so every
    sample is seen exactly once across ranks.

    ``fast_forward(n)`` skips the next ``n`` indices of the current epoch without touching
    the dataset; it is how a run resumed mid-epoch continues where it stopped.

    ``state_dict()`` is where it stands: the epoch and how many of this rank's indices of it
    were handed out, counted while iterating. A loader that checkpoints its sampler, such as
    torchdata's ``StatefulDataLoader``, resumes from there with ``load_state_dict()``. A state
    of an earlier epoch than the one ``set_epoch`` selected does not move the sampler back: that
    epoch starts from its first index (an epoch-end state does not replay its epoch).

    Example:
        >>> sampler = ResumableSampler(range(10), shuffle=True, seed=0)
        >>> sampler.set_epoch(1)
        >>> sampler.fast_forward(4)
        >>> len(sampler)
        6
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} and world_size={world_size}: need 0 <= rank < world_size")
        self.dataset_size = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.pad = pad
        self.epoch = 0
        self.skip = 0
        self._position = 0
        self._iterator: Optional[Iterator[int]] = None  # the live epoch's indices (a list iterator)
        self._shard_end = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` and forget any fast-forward."""
        self.epoch = epoch
        self.skip = self.position = 0
        self._epoch_set = True

    def fast_forward(self, num_indices: int) -> None:
        """Skip the first ``num_indices`` indices this rank would yield in the current epoch.

        The skipped samples are never loaded: the order is recomputed from seed and epoch and
        sliced. ``set_epoch`` resets it.

        Raises:
            ValueError: ``num_indices`` is negative or not an integer.
        """
        if isinstance(num_indices, bool) or not isinstance(num_indices, int) or num_indices < 0:
            raise ValueError(f"fast_forward(num_indices={num_indices!r}) is invalid; allowed: an integer >= 0")
        self.skip = self.position = num_indices

    def _shard_size(self) -> int:
        if self.pad:
            return -(-self.dataset_size // self.world_size)
        return len(range(self.rank, self.dataset_size, self.world_size))

    def __len__(self) -> int:
        return max(self._shard_size() - self.skip, 0)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_size))
        if self.pad and self.dataset_size % self.world_size:
            missing = self.world_size - self.dataset_size % self.world_size
            indices += (indices * (missing // max(len(indices), 1) + 1))[:missing]
        shard = indices[self.rank :: self.world_size]
        self._iterator, self._shard_end = iter(shard[self.skip :]), len(shard)
        return self._iterator

    @property
    def position(self) -> int:
        """Indices of this epoch handed out so far, skipped ones included (``state_dict()``'s ``skip``).

        Read off the live list iterator's remaining length: counting costs nothing per index."""
        if self._iterator is None:
            return self._position
        return self._shard_end - operator.length_hint(self._iterator)

    @position.setter
    def position(self, value: int) -> None:
        self._position, self._iterator = value, None

    def state_dict(self) -> Dict[str, Any]:
        """The epoch and the indices of it handed out so far (the order itself is derived from the seed).

        Example:
            >>> sampler = ResumableSampler(range(10), shuffle=True, seed=0)
            >>> iterator = iter(sampler); first_three = [next(iterator) for _ in range(3)]
            >>> sampler.state_dict()
            {'epoch': 0, 'skip': 3}
            >>> resumed = ResumableSampler(range(10), shuffle=True, seed=0)
            >>> resumed.load_state_dict(sampler.state_dict())
            >>> list(resumed) == list(sampler)[3:]
            True
        """
        return {"epoch": self.epoch, "skip": self.position}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: its epoch, from the next index. A state of
        an earlier epoch than the one ``set_epoch`` selected (an epoch that has ended) leaves the
        selected epoch, from its start."""
        epoch, position = int(state["epoch"]), int(state["skip"])
        if self._epoch_set and epoch < self.epoch:
            position, epoch = 0, self.epoch
        self.epoch, self.skip, self.position = epoch, position, position


def interleave_ranks(per_rank: List[Tuple[Any, ...]]) -> Tuple[Any, ...]:
    """Merge every rank's joined outputs into dataset order.

    The ordered evaluation :class:`ResumableSampler` gives rank ``r`` of ``W`` the samples ``r, r + W, ...``,
    so item ``j`` of rank ``r`` is sample ``j * W + r``. Dicts are merged key by key, lists
    (per-step values that are not tensors) are concatenated rank after rank, so the result
    has the shape a single process would give; anything else becomes a list over ranks.

    Example:
        >>> interleave_ranks([(torch.tensor([0, 2]), {"p": torch.tensor([0, 2])}), (torch.tensor([1]), {"p": torch.tensor([1])})])
        (tensor([0, 1, 2]), {'p': tensor([0, 1, 2])})
    """
    world_size = len(per_rank)
    ranks = [rank for rank, outputs in enumerate(per_rank) if outputs]  # fewer samples than ranks
    return tuple(
        _merge([per_rank[rank][position] for rank in ranks], ranks, world_size)
        for position in range(len(per_rank[ranks[0]]) if ranks else 0)
    )


def _merge(parts: List[Any], ranks: List[int], world_size: int) -> Any:
    if all(isinstance(part, torch.Tensor) and part.dim() > 0 for part in parts):
        order = torch.cat([torch.arange(len(part)) * world_size + rank for rank, part in zip(ranks, parts)])
        return torch.cat(parts)[torch.argsort(order)]
    if all(isinstance(part, Mapping) for part in parts) and all(part.keys() == parts[0].keys() for part in parts):
        return {key: _merge([part[key] for part in parts], ranks, world_size) for key in parts[0]}
    if all(isinstance(part, list) for part in parts):
        return [item for part in parts for item in part]
    return list(parts)
