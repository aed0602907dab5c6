"""Checkpoint IO: how a checkpoint's bytes reach storage and come back, safely.

``base`` holds :class:`CheckpointIO` (one file per checkpoint) and the refusal errors;
``sharded_checkpoint`` writes and reads a directory of shards (DCP) through the one reader
of ``dcp_reader`` and ``dcp_index``; ``local_files`` and ``stateful`` serve them.

Example:
    >>> from backends.checkpoint_io import is_sharded_checkpoint
    >>> is_sharded_checkpoint("model.pt")
    False
"""

from backends.checkpoint_io.base import (
    SHARDED_NAME,
    CheckpointIO,
    CheckpointRefused,
    CorruptCheckpoint,
    file_digest,
    is_sharded_checkpoint,
)

__all__ = ["SHARDED_NAME", "CheckpointIO", "CheckpointRefused", "CorruptCheckpoint", "file_digest", "is_sharded_checkpoint"]
