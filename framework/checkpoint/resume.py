"""Which checkpoint a run resumes from: the newest in a directory that reads back, past damaged ones."""

import logging
from typing import Callable, Optional, Tuple

from framework.checkpoint import storage
from framework.checkpoint.checkpoint import Checkpoint
from framework.checkpoint.retention import checkpoint_entries

logger = logging.getLogger("framework.checkpoint.default")  # the checkpointer's messages keep one logger name


def load_latest(source: str, read: Callable[[str], Checkpoint]) -> Optional[Tuple[Checkpoint, str]]:
    """The newest checkpoint in ``source`` that ``read`` reads back, and its URL; None when
    ``source`` holds no checkpoint.

    A damaged checkpoint (:class:`~framework.checkpoint.storage.CorruptCheckpoint`: truncated,
    a missing shard...) is reported and skipped for an older one; a refused one
    (:class:`~framework.checkpoint.storage.CheckpointRefused`) and any other error stop the search.

    Raises:
        RuntimeError: ``source`` holds checkpoints and none of them reads back.
    """
    fs, directory = storage.resolve(source)
    failures = []
    for _, path in checkpoint_entries(fs, directory):
        url = fs.unstrip_protocol(path)
        try:
            checkpoint = read(url)
        except storage.CheckpointRefused:
            raise
        except storage.CorruptCheckpoint as error:  # truncated or damaged: only these fall back
            logger.warning("checkpoint %s is unreadable and was skipped: %s", url, error)
            failures.append(f"{url}: {error}")
            continue
        if failures:
            logger.warning("resuming from the newest readable checkpoint %s instead", url)
        return checkpoint, url
    if failures:
        raise RuntimeError(
            f"{source} holds {len(failures)} checkpoint(s) and none reads back, so the run cannot resume; "
            f"move them away to start fresh. " + "; ".join(failures)
        )
    return None


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
