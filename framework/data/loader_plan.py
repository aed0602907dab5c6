"""Does the train loader use what the trainer handed it? Under DDP, a loader that ignores the
``sampler`` makes every rank train on the whole dataset, and one that ignores ``batch_size``
changes the global batch; a stream split by rank discards items, and streams of unequal
length drop the longer ranks' extra items. All run without an error, so the trainer warns at setup."""

import logging
from typing import Any, Callable, List, Optional

from torch.utils.data import DataLoader, IterableDataset

from backends.data.streams import ShardedStream, user_dataset

logger = logging.getLogger("framework")


class RecordingSampler:
    """The ``sampler`` callable handed to ``get_train_dataloader``: it calls the backend's
    factory and remembers every sampler it created, so the trainer can check the loader uses one.

    Example:
        >>> sampler = RecordingSampler(lambda dataset, shuffle=None: list(dataset))
        >>> made = sampler(range(3))
        >>> sampler.created == [made]
        True
    """

    def __init__(self, factory: Callable[..., Any]) -> None:
        self._factory = factory
        self.created: List[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        made = self._factory(*args, **kwargs)
        self.created.append(made)
        return made


def _samplers_of(loader: DataLoader) -> List[Any]:
    """The loader's sampler, its batch sampler's sampler, and what each of those wraps (one level)."""
    found = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    found += [getattr(sampler, "sampler", None) for sampler in found]
    return [sampler for sampler in found if sampler is not None]


def loader_plan_problems(
    loader: Any, sampler: RecordingSampler, batch_size: int, world_size: int, gradient_accumulation: int = 1
) -> List[str]:
    """What the train loader ignores of ``sampler`` and ``batch_size`` under DDP (empty: nothing,
    or nothing checkable: one process, a stream, a loader that is not a ``DataLoader``).

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> import torch
        >>> data = TensorDataset(torch.zeros(8, 1))
        >>> sampler = RecordingSampler(lambda dataset, shuffle=None: range(len(dataset)))
        >>> problems = loader_plan_problems(DataLoader(data, batch_size=4, shuffle=True), sampler, 2, world_size=2)
        >>> [problem.split(":")[0].split(",")[0] for problem in problems]
        ['the train DataLoader does not use the sampler handed to get_train_dataloader', 'the train DataLoader has batch_size=4']
    """
    if world_size <= 1 or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return []
    problems = []
    created = {id(made) for made in sampler.created}
    if not any(id(used) in created for used in _samplers_of(loader)):
        used = loader.sampler
        samples = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
        share = f" ({samples} samples per rank instead of about {-(-samples // world_size)})" if samples else ""
        problems.append(
            "the train DataLoader does not use the sampler handed to get_train_dataloader: it uses a "
            f"{type(used).__name__}, so each of the {world_size} ranks trains on the whole dataset every epoch{share}, "
            "and the framework can neither shuffle per epoch nor resume mid-epoch; build it with "
            "DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset)) (no shuffle=True)"
        )
    used_batch = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    if isinstance(used_batch, int) and used_batch != batch_size:
        asked = batch_size * world_size * gradient_accumulation
        actual = used_batch * world_size * gradient_accumulation
        problems.append(
            f"the train DataLoader has batch_size={used_batch}, but get_train_dataloader was asked for "
            f"batch_size={batch_size} (train_batch_size={asked} over {world_size} ranks"
            + (f" and {gradient_accumulation} accumulated micro-batches" if gradient_accumulation > 1 else "")
            + f"), so each optimizer step sees {actual} samples, not {asked}; pass batch_size=batch_size to the "
            "DataLoader and set the global batch with --trainer.train_batch_size"
        )
    return problems


def warn_if_loader_ignores_plan(
    loader: Any, sampler: RecordingSampler, batch_size: int, world_size: int, gradient_accumulation: int = 1
) -> List[str]:
    """Log each of :func:`loader_plan_problems` as a warning (rank zero prints it); return them."""
    problems = loader_plan_problems(loader, sampler, batch_size, world_size, gradient_accumulation)
    for problem in problems:
        logger.warning("%s", problem)
    return problems


def _length(obj: Any) -> Optional[int]:
    try:
        return len(obj)
    except TypeError:
        return None


def stream_share_problem(loader: Any, rank_lengths: List[Optional[int]], rank_items: List[Optional[int]]) -> Optional[str]:
    """One sentence on what a multi-rank stream loses per epoch (None: nothing, or not a stream).

    ``rank_lengths``: each rank's batches per epoch (None: no ``__len__``); ``rank_items``:
    how many items each rank's dataset holds before any split (None: unknown).

    Example:
        >>> class Replay(IterableDataset):
        ...     def __iter__(self):
        ...         return iter(range(10))
        ...     def __len__(self):
        ...         return 10
        >>> loader = DataLoader(ShardedStream(Replay(), rank=0, world_size=2), batch_size=5)
        >>> print(stream_share_problem(loader, [1, 1], [10, 10]))
        the train stream Replay does not declare shards_itself = True, so it is split over the 2 ranks: each rank keeps every 2nd item it reads and discards the rest (10 of 20 items per epoch over the ranks); if each rank's stream is its own (a per-rank replay buffer), set shards_itself = True on Replay
    """  # noqa: E501 - a doctest's expected message is one line
    dataset = getattr(loader, "dataset", None)
    world_size = len(rank_lengths)
    if world_size <= 1 or not isinstance(dataset, IterableDataset):
        return None
    name = type(user_dataset(dataset)).__name__
    parts = []
    if isinstance(dataset, ShardedStream):
        readers = dataset.world_size
        if all(items is not None for items in rank_items):
            total = sum(items or 0 for items in rank_items)
            kept = sum(len(range(rank, items or 0, readers)) for rank, items in enumerate(rank_items))
            lost = f" ({total - kept} of {total} items per epoch over the ranks)"
        else:
            lost = f" ({readers - 1} of every {readers} items each rank reads)"
        parts.append(
            f"the train stream {name} does not declare shards_itself = True, so it is split over the {readers} ranks: "
            f"each rank keeps every {_ordinal(readers)} item it reads and discards the rest{lost}; if each rank's "
            f"stream is its own (a per-rank replay buffer), set shards_itself = True on {name}"
        )
    if all(length is not None for length in rank_lengths):
        known = [length for length in rank_lengths if length is not None]
        shortest = min(known)
        if max(known) > shortest:
            per_rank = ", ".join(f"rank {rank}: {length - shortest}" for rank, length in enumerate(known) if length > shortest)
            batch = getattr(loader, "batch_size", None)
            items = f" ({sum(known) - shortest * world_size} x {batch} items)" if isinstance(batch, int) else ""
            parts.append(
                f"the ranks' {name} streams have {known} batches per epoch and every rank stops with the shortest, so "
                f"{sum(known) - shortest * world_size} batches{items} are dropped every epoch ({per_rank})"
            )
    elif getattr(user_dataset(dataset), "shards_itself", False):
        parts.append(
            f"the ranks' {name} streams have no __len__: every epoch ends on every rank when the shortest rank's stream "
            "runs out, and the longer ranks' remaining items are dropped (give it a __len__ to have them counted here)"
        )
    return "; ".join(parts) or None


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def warn_about_stream_shares(loader: Any, world_size: int, all_gather_object: Callable[[Any], List[Any]]) -> Optional[str]:
    """Log :func:`stream_share_problem` once (rank zero prints it); collective for a multi-rank stream."""
    dataset = getattr(loader, "dataset", None)
    if world_size <= 1 or not isinstance(dataset, IterableDataset):
        return None
    gathered = all_gather_object((_length(loader), _length(user_dataset(dataset))))
    problem = stream_share_problem(loader, [length for length, _ in gathered], [items for _, items in gathered])
    if problem:
        logger.warning("%s", problem)
    return problem
