"""Does the train loader use what the trainer handed it? Under DDP, a loader that ignores the
``sampler`` makes every rank train on the whole dataset, and one that ignores ``batch_size``
changes the global batch; both run without an error, so the trainer warns at setup."""

import logging
from typing import Any, Callable, List

from torch.utils.data import DataLoader, IterableDataset

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
