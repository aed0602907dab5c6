"""Every rank of a sharded checkpoint read agrees on each rank's own checks before any collective:
a problem on one rank is raised on every rank, of the same kind, so no rank enters DCP's
collective read without the others and a damaged checkpoint is skipped by all of them together."""

from typing import Any, Callable, List, Optional, Tuple

from backends.checkpoint_io.base import CheckpointIO, CheckpointRefused, CorruptCheckpoint, is_sharded_checkpoint

Gather = Callable[[Any], List[Any]]
"""A strategy's ``all_gather_object``: every rank's object, in rank order (collective)."""


def agree_readable(path: str, io: CheckpointIO, gather: Gather) -> None:
    """Every rank checks ``path`` alone (is it a directory, do its files verify); a problem on any
    rank, or ranks that see different things there, is raised on every rank (collective)."""
    from backends.checkpoint_io import sharded_checkpoint

    sharded, problem = is_sharded_checkpoint(path), None
    try:
        if sharded:
            sharded_checkpoint.verify(path, io)
    except (OSError, ValueError) as error:  # FileNotFoundError, CorruptCheckpoint, CheckpointRefused
        problem = error
    found = gather((sharded, _described(problem)))
    if problem is not None:
        raise problem
    for rank, (rank_sharded, failure) in enumerate(found):
        if failure is not None:
            raise _of_the_same_kind(rank, failure, OSError)
        if rank_sharded != sharded:
            raise CorruptCheckpoint(f"rank {rank} sees {'a directory' if rank_sharded else 'no directory'} at {path}")


def raise_on_every_rank(problem: Optional[BaseException], gather: Gather) -> None:
    """Raise on every rank when any rank has a ``problem`` (collective): this rank's own, or one of
    the same kind naming the rank that had it (a RuntimeError for a failure other than a damaged
    or refused checkpoint)."""
    found = gather(_described(problem))
    if problem is not None:
        raise problem
    for rank, failure in enumerate(found):
        if failure is not None:
            raise _of_the_same_kind(rank, failure, RuntimeError)


def _described(problem: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if problem is None else (type(problem).__name__, str(problem))


def _of_the_same_kind(rank: int, failure: Tuple[str, str], otherwise: type) -> BaseException:
    """Another rank's ``failure`` (its type's name, its text) raised here: a damaged or refused
    checkpoint as such (every rank then skips or refuses it alike), any other as ``otherwise``."""
    kind = {"CorruptCheckpoint": CorruptCheckpoint, "CheckpointRefused": CheckpointRefused}.get(failure[0], otherwise)
    return kind(f"rank {rank} cannot read it: {failure[0]}: {failure[1]}")
