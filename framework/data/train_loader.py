"""The train loader as the trainer runs it: built once from the module, its length agreed by the
ranks, its position in the epoch and its seeds, and how many steps an epoch has."""

import math
from typing import Any, Iterator, List, Optional

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.data.loader_plan import RecordingSampler, warn_about_stream_shares, warn_if_loader_ignores_plan
from framework.data.loader_position import LoaderPosition
from framework.data.sample_randomness import LoaderSeeding
from framework.loop import module_checks as checks
from framework.module import ModuleInterface


class TrainLoader:
    """The module's train loader for micro-batches of ``micro_batch_size``, prepared by the backend.

    ``length`` is the number of micro-batches every rank can read (the smallest share), or None
    for a stream; ``position`` resumes it mid-epoch; ``seeding`` derives its workers' seeds.

    Args:
        module: builds the loader (``get_train_dataloader``).
        backend: provides the sampler and prepares the loader (streams sharded by rank).
        args: ``seed`` and ``max_train_steps_per_epoch``.
        micro_batch_size: the per-process micro-batch.
        accumulation: micro-batches per optimizer step.

    Example:
        loader = TrainLoader(module, backend, args, micro_batch_size=32, accumulation=1)
        batches = loader.start_epoch(epoch=0, samples_done=0)
    """

    def __init__(
        self,
        module: ModuleInterface,
        backend: TrainerBackend,
        args: TrainerArguments,
        micro_batch_size: int,
        accumulation: int,
    ) -> None:
        self.args, self.micro_batch_size, self.accumulation = args, micro_batch_size, accumulation
        sampler = RecordingSampler(backend.sampler_factory(shuffle=True, seed=args.seed))
        loader = module.get_train_dataloader(sampler, micro_batch_size)
        checks.check_train_dataloader(loader)
        warn_if_loader_ignores_plan(loader, sampler, micro_batch_size, backend.data_parallel_size, accumulation)
        self.loader = backend.prepare_loader(loader)
        try:
            length: Optional[int] = len(self.loader)
        except TypeError:
            length = None
        self.length = None if length is None else backend.min_over_ranks(length)
        warn_about_stream_shares(self.loader, backend.data_parallel_size, lambda obj: _one_per_share(backend, obj))
        checks.check_train_loader_not_empty(self.loader, self.length, micro_batch_size)
        self.position = LoaderPosition(self.loader)
        self.seeding = LoaderSeeding(self.loader, args.seed)

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps per epoch: exact when the loader has a length, else None (or
        ``max_train_steps_per_epoch`` when that is an int). A last, partial accumulation cycle
        counts as a step."""
        limit = self.args.max_train_steps_per_epoch
        if self.length is None:
            return limit if isinstance(limit, int) else None
        steps = math.ceil(self.length / self.accumulation)
        if isinstance(limit, float):
            return max(1, math.floor(limit * steps))
        return min(steps, limit) if limit is not None else steps

    @property
    def micro_batches_per_epoch(self) -> Optional[int]:
        """Micro-batches this rank reads in an epoch (None: until a stream ends)."""
        steps = self.steps_per_epoch
        if steps is None:
            return None
        if self.length is None:
            return steps * self.accumulation
        return min(self.length, steps * self.accumulation)

    def start_epoch(self, epoch: int, micro_batches_done: int) -> Iterator[Any]:
        """Position the sampler where ``epoch`` continues and seed its workers; its iterator."""
        self.position.start_epoch(epoch, micro_batches_done * self.micro_batch_size)
        self.seeding.start_epoch(epoch)  # before iter: seeds its workers
        return iter(self.loader)


def _one_per_share(backend: TrainerBackend, obj: Any) -> List[Any]:
    """Every rank's ``obj``, one per data-parallel rank (tensor-parallel peers read the same share)."""
    gathered = backend.all_gather_object(obj)
    return [gathered[rank] for rank in backend.data_parallel_representatives()]
