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
  and whichever run, loads it.

Example:
    class Augmented(torch.utils.data.Dataset):
        def __getitem__(self, index):
            noise = torch.randn(3, generator=framework.sample_generator(index))
            return self.x[index] + 0.1 * noise, self.y[index]
"""

import logging
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader

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


class _SeedingWorkerInit:
    """``worker_init_fn`` of a train loader: points the worker at the shared (seed, epoch), then
    calls the user's own ``worker_init_fn``. Picklable (``spawn`` start method)."""

    def __init__(self, state: torch.Tensor, user_init: Optional[Callable[[int], Any]]) -> None:
        self.state = state
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        global _STATE
        _STATE = self.state
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
        """One line at start: with workers, randomness a dataset draws from the global RNG does not
        resume exactly mid-epoch (which worker loads which sample changes); name the helper."""
        workers = getattr(self.loader, "num_workers", 0)
        if workers and resumable_mid_epoch:
            logger.warning(
                "the train loader has num_workers=%d: random augmentation that draws from the global RNG in __getitem__ "
                "does not resume exactly mid-epoch; draw it from framework.sample_generator(index) (docs/data-pipelines.md)",
                workers,
            )
