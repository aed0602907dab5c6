"""Streams (``IterableDataset``): each rank, and each loader worker inside a rank, reads its own shard."""

import itertools
import logging
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

logger = logging.getLogger(__name__)


class ShardedStream(IterableDataset):
    """Every ``world_size * num_workers``-th item of ``dataset``, starting at this reader's index.

    Reader ``rank * num_workers + worker_id`` of a loader with ``num_workers`` workers
    (``get_worker_info``; one reader per rank without workers) yields items
    ``reader, reader + readers, ...``: the ranks train on distinct shards and the workers of a
    rank never duplicate each other. Every reader iterates the whole stream and keeps its
    share; a dataset that splits itself more cheaply declares ``shards_itself = True`` and is
    left alone. It has a length only when ``dataset`` has one (this rank's share of it).

    Args:
        dataset: the user's stream.
        rank: this process's rank.
        world_size: number of ranks.

    Example:
        >>> class Count(IterableDataset):
        ...     def __iter__(self):
        ...         return iter(range(10))
        >>> list(ShardedStream(Count(), rank=1, world_size=3))
        [1, 4, 7]
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} and world_size={world_size}: need 0 <= rank < world_size")
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers = self.world_size * workers
        return itertools.islice(iter(self.dataset), self.rank * workers + worker, None, readers)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.world_size))  # type: ignore[arg-type]


def user_dataset(dataset: Any) -> Any:
    """The user's dataset behind a :class:`ShardedStream` (``dataset`` itself otherwise), for messages.

    Example:
        >>> class Count(IterableDataset):
        ...     def __iter__(self):
        ...         return iter(range(3))
        >>> type(user_dataset(ShardedStream(Count(), rank=0, world_size=2))).__name__
        'Count'
    """
    return dataset.dataset if isinstance(dataset, ShardedStream) else dataset


def shard_stream(loader: Any, rank: int, world_size: int) -> Any:
    """``loader`` with its ``IterableDataset`` replaced by a :class:`ShardedStream` when needed.

    Needed when there are several ranks or loader workers, the dataset is a stream (a
    map-style dataset is split by the sampler), it does not declare ``shards_itself = True``
    and is not sharded already. Only a ``torch.utils.data.DataLoader`` (or a subclass) is
    changed; any other iterable is returned as it is.
    """
    dataset = getattr(loader, "dataset", None)
    if not isinstance(loader, DataLoader) or not isinstance(dataset, IterableDataset):
        return loader
    if isinstance(dataset, ShardedStream) or getattr(dataset, "shards_itself", False):
        return loader
    if world_size == 1 and loader.num_workers == 0:
        return loader
    logger.debug("sharding %s over %d rank(s) x %d worker(s)", type(dataset).__name__, world_size, max(loader.num_workers, 1))
    # DataLoader forbids re-assigning ``dataset`` after construction; the loader has not
    # started iterating, so replacing it here is the same as having passed the wrapper.
    object.__setattr__(loader, "dataset", ShardedStream(dataset, rank, world_size))
    return loader
