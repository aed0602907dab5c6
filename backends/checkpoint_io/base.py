"""CheckpointIO: how one checkpoint file is written and read, and the errors a damaged or unsafe
checkpoint raises.

The strategies decide which ranks write what (one file from rank zero, or shards from every
rank); the file-level work goes through a :class:`CheckpointIO` that the checkpointer supplies
(``framework.checkpoint`` passes one that writes atomically through fsspec and loads with
``weights_only``), as Fabric's strategies do with their ``CheckpointIO``.
"""

import hashlib
import os
import re
from typing import Any

import torch

from backends.checkpoint_io.errors import CheckpointRefused as CheckpointRefused
from backends.checkpoint_io.errors import CheckpointWriteError as CheckpointWriteError
from backends.checkpoint_io.errors import CorruptCheckpoint as CorruptCheckpoint
from backends.checkpoint_io.local_files import local_path

SHARDED_NAME = re.compile(r"^checkpoint-(\d+)$")
"""A sharded checkpoint is a directory named ``checkpoint-<step>``; a whole one a file ``checkpoint-<step>.pt``."""


class CheckpointIO:
    """Writes and reads one checkpoint file.

    The default writes with ``torch.save`` through fsspec and reads with
    ``torch.load(weights_only=True)``; the framework's checkpointer passes its own (atomic
    writes, CRC checks, retries, refusal of unsafe pickles).

    Example:
        >>> io = CheckpointIO()
        >>> io.write("memory://doc-io/state.pt", {"w": torch.ones(2)})
        >>> io.read("memory://doc-io/state.pt")["w"]
        tensor([1., 1.])
    """

    weights_only = True
    """True: nothing read may run code (sharded indexes are read by an unpickler that admits only DCP's index classes)."""

    def write(self, path: str, obj: Any) -> None:
        """Write ``obj`` to ``path`` (a local path or fsspec URL)."""
        from backends.checkpoint_io import run_files  # the one door for files

        fs, inner = run_files.filesystem(path)
        run_files.write_file(fs, inner, lambda handle: torch.save(obj, handle))

    def read(self, path: str) -> Any:
        """Read what :meth:`write` wrote, onto the CPU.

        Raises:
            CorruptCheckpoint: the file is damaged.
            CheckpointRefused: the file holds what safe loading refuses.
        """
        from backends.checkpoint_io import run_files  # the one door for files

        fs, inner = run_files.filesystem(path)
        return run_files.load_torch(fs, inner, run_files.CHECKPOINT, weights_only=self.weights_only)

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` that training may not change (CPU tensors), for background writes."""
        return _cpu_copy(obj)


def file_digest(path: str) -> str:
    """SHA-256 of the file at ``path`` (local path or fsspec URL), as hex.

    Example:
        >>> import fsspec
        >>> with fsspec.open("memory://doc-io/bytes", "wb") as handle:
        ...     _ = handle.write(b"abc")
        >>> file_digest("memory://doc-io/bytes")[:12]
        'ba7816bf8f01'
    """
    from backends.checkpoint_io import run_files  # the one door for files

    digest = hashlib.sha256()
    fs, inner = run_files.filesystem(path)
    with run_files.open_file(fs, inner, run_files.DCP_SHARD) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_sharded_checkpoint(path: str) -> bool:
    """True when ``path`` is a directory (a sharded checkpoint), False for a file."""
    local = local_path(str(path))
    if local is not None:
        return os.path.isdir(local)
    import fsspec  # on first use

    fs, inner = fsspec.core.url_to_fs(str(path))
    return bool(fs.isdir(inner))


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((key, _cpu_copy(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cpu_copy(value) for value in obj)
    return obj
