"""Which checkpoint a run resumes from: the newest in a directory that reads back, past damaged ones."""

import logging
import socket
from typing import Any, Callable, List, Optional, Tuple

from framework.checkpoint import storage
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.retention import basename, checkpoint_entries

logger = logging.getLogger("framework.checkpoint.default")  # the checkpointer's messages keep one logger name


def load_latest(
    source: str, read: Callable[[str], Checkpoint], gather: Optional[Callable[[Any], List[Any]]] = None
) -> Optional[Tuple[Checkpoint, str]]:
    """The newest checkpoint in ``source`` that ``read`` reads back, and its URL; None when
    ``source`` holds no checkpoint.

    A damaged checkpoint (:class:`~framework.checkpoint.storage.CorruptCheckpoint`: truncated,
    a missing shard...) is reported and skipped for an older one; a refused one
    (:class:`~framework.checkpoint.storage.CheckpointRefused`) and any other error stop the search.

    ``gather`` (the strategy's ``all_gather_object``, when every rank calls this to read
    collectively): the ranks first agree that they see the same checkpoints in ``source``, and
    after each read that it read back on every rank, so all of them resume from one checkpoint,
    skip one together, or stop together; none enters a collective read the others do not.

    Raises:
        RuntimeError: ``source`` holds checkpoints and none of them reads back; or (``gather``)
            the ranks see different checkpoints there, or another rank failed to read one.
    """
    fs, directory = storage.resolve(source)
    entries = checkpoint_entries(fs, directory)
    if gather is not None:
        _agree_on_entries(source, [basename(path) for _, path in entries], gather)
    failures = []
    for _, path in entries:
        url = fs.unstrip_protocol(path)
        checkpoint: Optional[Checkpoint] = None
        problem: Optional[BaseException] = None
        skipped: Optional[str] = None
        try:
            checkpoint = read(url)
        except storage.CorruptCheckpoint as error:  # truncated or damaged: only these fall back
            problem, skipped = error, str(error)
        except Exception as error:  # refused, or another failure: stops the search
            if gather is None:
                raise
            problem = error
        if gather is not None:
            skipped = _agree_on_read(url, problem, gather)
        if skipped is not None:
            logger.warning("checkpoint %s is unreadable and was skipped: %s", url, skipped)
            failures.append(f"{url}: {skipped}")
            continue
        if failures:
            logger.warning("resuming from the newest readable checkpoint %s instead", url)
        assert checkpoint is not None  # read returned on this rank
        return checkpoint, url
    if failures:
        raise RuntimeError(
            f"{source} holds {len(failures)} checkpoint(s) and none reads back, so the run cannot resume; "
            f"move them away to start fresh. " + "; ".join(failures)
        )
    return None


def _agree_on_entries(source: str, names: List[str], gather: Callable[[Any], List[Any]]) -> None:
    """Raise on every rank unless every rank lists the same checkpoints in ``source``."""
    everyone = gather((socket.gethostname(), names))
    if any(seen != everyone[0][1] for _, seen in everyone):
        listed = "; ".join(
            f"rank {rank} (host {host}): {', '.join(seen) or 'none'}" for rank, (host, seen) in enumerate(everyone)
        )
        raise RuntimeError(
            f"the ranks see different checkpoints in {source}: {listed}. Every rank must resume from the same "
            "checkpoint: put save_dir/load_dir on a shared filesystem that every node mounts, or an fsspec URL that "
            "every node reaches (see docs/many-machines.md)"
        )


def _agree_on_read(url: str, problem: Optional[BaseException], gather: Callable[[Any], List[Any]]) -> Optional[str]:
    """After every rank read ``url``: None when it read back everywhere, why when it is damaged on
    some rank (every rank skips it); another rank's other failure is raised here, this rank's own too."""
    damaged = isinstance(problem, storage.CorruptCheckpoint)
    everyone = gather(None if problem is None else (damaged, f"{type(problem).__name__}: {problem}"))
    if problem is not None and not damaged:
        raise problem
    for rank, failure in enumerate(everyone):
        if failure is not None and not failure[0]:
            raise RuntimeError(f"rank {rank} failed to read checkpoint {url}: {failure[1]}")
    reasons = [f"rank {rank}: {failure[1]}" for rank, failure in enumerate(everyone) if failure is not None]
    return "; ".join(reasons) if reasons else None


def loaded_directory(loaded_from: Optional[str]) -> str:
    """The directory of the checkpoint (file or sharded directory) at ``loaded_from``.

    Example:
        >>> loaded_directory("s3://bucket/run/checkpoint-000000005.pt"), loaded_directory("checkpoint-000000005")
        ('s3://bucket/run', '.')
    """
    if loaded_from is None:
        raise RuntimeError("a checkpoint was loaded without recording where from")
    path = loaded_from.rstrip("/")
    return path.rsplit("/", 1)[0] if "/" in path else "."
