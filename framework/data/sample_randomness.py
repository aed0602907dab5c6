"""Randomness of the train loader that survives a resume: loader seeds derived from (seed, epoch),
and per-sample generators derived from (seed, epoch, index), valid inside loader workers.

Creating a DataLoader iterator draws the workers' base seed from the global RNG, and
persistent workers draw it once, for their whole life; random augmentation in ``__getitem__``
continues each worker's stream. None of that is in a checkpoint. The trainer therefore:

- gives its train loader a ``generator`` seeded from ``(seed, epoch)`` before each epoch
  (unless the loader has its own), so an iterator never draws from the global RNG and workers
  started at an epoch are seeded alike in every run;
- publishes ``(seed, epoch)`` to the loader's workers (shared memory, read when a sample is
  drawn), so :func:`sample_generator` gives the same numbers for a sample whichever worker,
  and whichever run, loads it;
- in each loader worker, seeds the global generators of torch, numpy and ``random`` from
  ``(seed, epoch, index)`` before every ``__getitem__`` of a map-style dataset, so augmentation
  written the usual way (``torch.randn``, ``np.random``, ``random``, torchvision transforms)
  resumes exactly too. With ``num_workers=0`` the main process's generators are left alone
  (they drive dropout and the training step): use :func:`sample_generator` there.

Example:
    class Augmented(torch.utils.data.Dataset):
        def __getitem__(self, index):
            noise = torch.randn(3, generator=framework.sample_generator(index))
            return self.x[index] + 0.1 * noise, self.y[index]
"""

import logging
import operator
import random
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

logger = logging.getLogger("framework")

_MASK = (1 << 64) - 1
_STATE: Optional[torch.Tensor] = None
"""``[seed, epoch]`` of the train loader this process (or worker) serves, in shared memory."""


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit value from any 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def derive_seed(*parts: int) -> int:
    """A seed in ``[0, 2**63)`` that depends on every part (order included).

    Example:
        >>> derive_seed(42, 0, 7) == derive_seed(42, 0, 7) != derive_seed(42, 1, 7)
        True
    """
    value = 0
    for part in parts:
        value = _mix(value ^ (int(part) & _MASK))
    return value >> 1


def sample_seed(index: int) -> int:
    """The seed of sample ``index`` in the current epoch: derived from (trainer seed, epoch, index).

    For ``numpy.random.default_rng(sample_seed(index))`` or ``random.Random(sample_seed(index))``.
    Outside a trainer's train loader (a dataset indexed by hand, an evaluation loader started
    with the ``spawn`` method) seed 0 and epoch 0 are used.
    """
    seed, epoch = (0, 0) if _STATE is None else _STATE.tolist()
    return derive_seed(seed, epoch, index)


def sample_generator(index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for sample ``index``'s randomness in the current epoch.

    Seeded from (trainer seed, epoch, index): a sample gets the same numbers in every run,
    in whichever loader worker loads it, and after a resume at any step, so augmentation
    drawn from it resumes exactly (``torch.randn(..., generator=sample_generator(index))``).
    Valid inside loader workers (persistent ones included) and with ``num_workers=0``.
    """
    return torch.Generator().manual_seed(sample_seed(index))


def seed_global_generators(seed: int) -> None:
    """Seed torch's, numpy's (when imported) and ``random``'s global generators from ``seed``.

    Example:
        >>> seed_global_generators(3); first = torch.rand(1)
        >>> seed_global_generators(3); torch.equal(first, torch.rand(1))
        True
    """
    torch.default_generator.manual_seed(seed)  # the CPU generator: torch.manual_seed also visits every accelerator
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed & 0xFFFFFFFF)


_SEEDED_CLASSES: Dict[type, type] = {}


def _seeded_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__getitem__`` (and ``__getitems__``) first seeds the global
    generators from the sample's index; same name, so errors still name the user's class."""
    seeded = _SEEDED_CLASSES.get(cls)
    if seeded is not None:
        return seeded

    def __getitem__(self: Any, index: Any) -> Any:
        _seed_for(index)
        return cls.__getitem__(self, index)  # type: ignore[index]

    namespace: Dict[str, Any] = {"__getitem__": __getitem__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    batched = getattr(cls, "__getitems__", None)
    if batched is not None:

        def __getitems__(self: Any, indices: Sequence[Any]) -> List[Any]:
            if len(indices):  # one batched call: seeded by its first sample (the batch is fixed by the sampler)
                _seed_for(indices[0])
            return batched(self, indices)

        namespace["__getitems__"] = __getitems__
    seeded = _SEEDED_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return seeded


def _seed_for(index: Any) -> None:
    try:
        position = operator.index(index)
    except TypeError:
        return  # not an integer index (a key, a slice): nothing to derive a seed from
    seed_global_generators(sample_seed(position))


def seed_globals_per_sample(dataset: Any) -> bool:
    """In a loader worker: make every ``dataset[index]`` start from generators seeded by
    (seed, epoch, index). False (left alone) for streams and classes that cannot be extended."""
    if isinstance(dataset, IterableDataset) or not callable(getattr(type(dataset), "__getitem__", None)):
        return False
    try:
        dataset.__class__ = _seeded_class(type(dataset))
    except TypeError:  # a builtin or a layout that forbids it
        return False
    return True


class _SeedingWorkerInit:
    """``worker_init_fn`` of a train loader: points the worker at the shared (seed, epoch), then
    calls the user's own ``worker_init_fn``. Picklable (``spawn`` start method)."""

    def __init__(self, state: torch.Tensor, user_init: Optional[Callable[[int], Any]]) -> None:
        self.state = state
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        global _STATE
        _STATE = self.state
        info = get_worker_info()
        if info is not None:
            seed_globals_per_sample(info.dataset)
        if self.user_init is not None:
            self.user_init(worker_id)


class LoaderSeeding:
    """Seeds one train loader per epoch and publishes (seed, epoch) to :func:`sample_generator`.

    Args:
        loader: the train loader (anything that is not a torch ``DataLoader`` is left alone,
            but :func:`sample_generator` still follows the epoch in this process).
        seed: the run's seed.

    Example:
        >>> loader = DataLoader(list(range(4)), batch_size=2)
        >>> seeding = LoaderSeeding(loader, seed=42)
        >>> seeding.start_epoch(3)
        >>> sample_seed(5) == derive_seed(42, 3, 5)
        True
    """

    def __init__(self, loader: Any, seed: int) -> None:
        self.loader = loader
        self.seed = int(seed)
        self.state = torch.tensor([self.seed, 0], dtype=torch.int64).share_memory_()
        self._owns_generator = isinstance(loader, DataLoader) and loader.generator is None
        if isinstance(loader, DataLoader) and loader.num_workers > 0:
            loader.worker_init_fn = _SeedingWorkerInit(self.state, loader.worker_init_fn)

    def start_epoch(self, epoch: int) -> None:
        """Before the epoch's iterator is created: the loader's generator and the shared epoch."""
        global _STATE
        self.state[1] = int(epoch)
        _STATE = self.state
        if self._owns_generator:
            self.loader.generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch))

    def warn_about_worker_randomness(self, resumable_mid_epoch: bool) -> None:
        """One line at start: a stream read by workers that draws from the global RNG does not
        resume exactly mid-epoch (it has no sample index to seed from); name the helper."""
        workers = getattr(self.loader, "num_workers", 0)
        if workers and resumable_mid_epoch and isinstance(getattr(self.loader, "dataset", None), IterableDataset):
            logger.warning(
                "the train stream is read by num_workers=%d: random augmentation that draws from the global RNG in "
                "__iter__ does not resume exactly mid-epoch; draw it from framework.sample_generator(index) "
                "(docs/data-pipelines.md)",
                workers,
            )
