"""The kinds of run files: what messages call each, the most bytes it may hold, the error its refusal raises."""

from dataclasses import dataclass
from typing import Tuple, Type

from backends.checkpoint_io.errors import CorruptCheckpoint

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class UnsafeRunFile(ValueError):
    """A run file that is not a regular file of a sane size (a symlink, FIFO, device, directory,
    or larger than its kind admits); the message names the file and what was found.

    Example:
        >>> raise UnsafeRunFile("config.yaml /run/config.yaml is a symbolic link, not a regular file")
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.run_files.kinds.UnsafeRunFile: config.yaml /run/config.yaml is a symbolic link, not a regular file
    """


@dataclass(frozen=True)
class FileKind:
    """One kind of run file: what messages call it, the most bytes it may hold, the error its refusal raises.

    Example:
        >>> FileKind("notes", 10).limit
        10
    """

    name: str
    limit: int
    error: Type[Exception] = UnsafeRunFile


CONFIG = FileKind("config.yaml", 64 * MiB)


RUN_ID = FileKind("run id record", 4 * KiB)


METRICS = FileKind("metrics.csv", 4 * GiB)


LOCK = FileKind("run lock", MiB)  # its reader reads a few KiB of it at most


PROBE = FileKind("shared-storage probe", 4 * KiB)


CHECKPOINT = FileKind("checkpoint", 1 << 50, CorruptCheckpoint)


STATE = FileKind("sharded checkpoint's state.pt", 1 << 40, CorruptCheckpoint)


DCP_INDEX = FileKind("sharded checkpoint index .metadata", GiB, CorruptCheckpoint)


DCP_SHARD = FileKind("sharded checkpoint shard", 1 << 50, CorruptCheckpoint)


SAFETENSORS = FileKind("safetensors file", 1 << 50, CorruptCheckpoint)


SAFETENSORS_INDEX = FileKind("safetensors index", 8 * MiB, CorruptCheckpoint)  # its JSON parsed whole


PREDICTIONS = FileKind("prediction part", 1 << 40, CorruptCheckpoint)
KINDS: Tuple[FileKind, ...] = (
    CONFIG,
    RUN_ID,
    METRICS,
    LOCK,
    PROBE,
    CHECKPOINT,
    STATE,
    DCP_INDEX,
    DCP_SHARD,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    PREDICTIONS,
)
"""Every kind the door handles (the hostile-input test walks them all)."""

# Protocols whose uploads are atomic: the object appears only once its upload completes.
