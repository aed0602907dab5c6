"""Where the train loader stands in an epoch, and whether it can continue mid-epoch after a resume."""

import logging
from typing import Any, List, Optional

from torch.utils.data import IterableDataset

from backends.data.streams import user_dataset

logger = logging.getLogger("framework")


class LoaderPosition:
    """Positions the train loader at each epoch's start, and decides at setup whether a
    checkpoint taken mid-epoch could be resumed.

    A loader resumes mid-epoch when one of these holds (checked in this order):

    - ``"sampler"``: its sampler (or its batch sampler's sampler) has ``fast_forward(n)``, as
      the framework's ``sampler(dataset)`` does: the skipped samples are never loaded;
    - ``"loader_state"``: the loader has ``state_dict()`` / ``load_state_dict()`` (torchdata's
      ``StatefulDataLoader`` protocol); its state is saved per rank in every checkpoint;
    - ``"dataset_state"``: the dataset has ``state_dict()`` / ``load_state_dict()`` and the
      loader has no workers (whose copies of the dataset the main process cannot see).

    Otherwise (``RandomSampler``, ``DistributedSampler``, a stream without state, ...)
    :attr:`reason` says why, the trainer warns once at start and saves only at epoch ends.

    A loader (or, without workers, a dataset) with ``state_dict()`` / ``load_state_dict()`` has
    its state saved per rank in every checkpoint and restored on every rank at every resume,
    epoch-end checkpoints included (a replay buffer or a reader that continues where the last
    epoch stopped outlives the epoch). On another world size, rank ``r`` gets the state of
    saved rank ``r % saved world size``, as for the RNG streams.

    Args:
        loader: the train loader, as the trainer iterates it.

    Example:
        >>> from torch.utils.data import DataLoader, RandomSampler
        >>> data = list(range(8))
        >>> LoaderPosition(DataLoader(data, sampler=RandomSampler(data))).resumable_mid_epoch
        False
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.samplers = _samplers(loader)
        self._pending_state: Optional[Any] = None
        self._skipped = False
        self.mode, self.reason = _resume_mode(loader, self.samplers)
        self.stateful = _stateful_part(loader)
        """The loader or dataset whose ``state_dict`` checkpoints keep, or None."""

    @property
    def resumable_mid_epoch(self) -> bool:
        """True when a checkpoint taken inside an epoch can continue exactly there."""
        return self.mode is not None

    def warn_if_not_resumable(self) -> None:
        """Say once, at the start of training, that checkpoints are kept to epoch ends."""
        if not self.resumable_mid_epoch:
            logger.warning("%s; checkpoints are saved only at epoch ends (step and mid-epoch saves are skipped)", self.reason)

    def skip_save(self, global_step: int) -> None:
        """Log a mid-epoch save that is skipped, and why (in full the first time)."""
        if not self._skipped:
            logger.warning("no checkpoint at step %d (mid-epoch): %s", global_step, self.reason)
        else:
            logger.info("no checkpoint at step %d (mid-epoch): the train loader cannot resume there", global_step)
        self._skipped = True

    def start_epoch(self, epoch: int, samples_done: int) -> None:
        """Select ``epoch``'s order and skip the ``samples_done`` this rank already trained on.

        Raises:
            ValueError: ``samples_done > 0`` (a mid-epoch checkpoint) with a loader that cannot resume there.
        """
        for sampler in self.samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        state, self._pending_state = self._pending_state, None
        if state is not None and self.stateful is not None:  # at an epoch end too: the state outlives epochs
            self.stateful.load_state_dict(state)
        if not samples_done:
            return
        if self.mode == "sampler":
            next(s for s in self.samplers if hasattr(s, "fast_forward")).fast_forward(samples_done)
        elif self.mode in ("loader_state", "dataset_state") and state is not None:
            pass  # the state loaded above continues the epoch
        else:
            sampler = self.samplers[0] if self.samplers else None
            raise ValueError(
                f"resuming mid-epoch needs the train loader's sampler to support fast_forward(n), and "
                f"{type(sampler).__name__} does not ({self.reason}); build it with the sampler(dataset) callable handed to "
                "get_train_dataloader, or resume from a checkpoint taken at an epoch end"
            )

    def state_dict(self) -> Optional[Any]:
        """The loader's or dataset's own state (this rank's), or None when neither has one."""
        return None if self.stateful is None else self.stateful.state_dict()

    def load_state_dict(self, state: Optional[Any]) -> None:
        """Keep ``state`` for the next :meth:`start_epoch`, which loads it (mid-epoch or at an epoch start)."""
        self._pending_state = state


def _samplers(loader: Any) -> List[Any]:
    found: List[Any] = []
    for candidate in (getattr(getattr(loader, "batch_sampler", None), "sampler", None), getattr(loader, "sampler", None)):
        if candidate is not None and all(candidate is not other for other in found):
            found.append(candidate)
    return sorted(found, key=lambda sampler: not hasattr(sampler, "fast_forward"))  # the one that fast-forwards first


def _stateful_part(loader: Any) -> Optional[Any]:
    """The loader when it has the state protocol, else its dataset when it has and no worker copies it."""
    if _has_state_protocol(loader):
        return loader
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and _has_state_protocol(dataset) and getattr(loader, "num_workers", 0) == 0:
        return dataset
    return None


def _has_state_protocol(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _resume_mode(loader: Any, samplers: List[Any]) -> "tuple[Optional[str], str]":
    dataset = getattr(loader, "dataset", None)
    name = type(user_dataset(dataset)).__name__  # the user's class, not the framework's ShardedStream
    if _has_state_protocol(loader):
        return "loader_state", ""
    if not isinstance(dataset, IterableDataset) and any(hasattr(sampler, "fast_forward") for sampler in samplers):
        return "sampler", ""
    if dataset is not None and _has_state_protocol(dataset):
        if getattr(loader, "num_workers", 0) == 0:
            return "dataset_state", ""
        return None, (
            f"the train dataset {name} has state_dict() but the loader reads it in "
            f"{loader.num_workers} worker processes, whose copies the trainer cannot see; use torchdata's "
            "StatefulDataLoader or num_workers=0 to resume mid-epoch"
        )
    if isinstance(dataset, IterableDataset):
        return None, (
            f"the train dataset {name} is a stream (IterableDataset) without state_dict()/"
            "load_state_dict(), so a run cannot continue inside an epoch"
        )
    names = ", ".join(type(sampler).__name__ for sampler in samplers) or "none"
    return None, (
        f"the train loader's sampler ({names}) has no fast_forward(n), so a run cannot continue inside an epoch; "
        "build it with the sampler(dataset) callable handed to get_train_dataloader (sampler(dataset, shuffle=False) "
        "for ordered data)"
    )
