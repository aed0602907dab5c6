"""The one door for a run's files: every byte of ``config.yaml``, ``run_id``, ``metrics.csv``,
checkpoints, their indexes and shards, ``state.pt``, safetensors and exports is read and written here.

Reads take **regular files only**: on a local disk the file is opened with ``O_NOFOLLOW`` (a
symlink in its place is refused, never followed out of the run) and ``O_NONBLOCK`` (a FIFO
cannot hang the run), then checked with ``fstat``: a device (``/dev/zero``), a FIFO or a
directory is refused before a byte is read, and so is a file larger than its kind's limit
(:class:`FileKind`). :func:`read_bytes` reads at most the limit plus one byte. On other
filesystems (fsspec URLs) the entry's type and size are checked before it is opened.

Writes go to a temporary name beside the target and are renamed into place with
``os.replace``: a symlink at the target is replaced, never written through, and a crash leaves
the old file or the new one, never half of one. Listings (:func:`list_entries`) leave symlinks out.

Every refusal is the kind's own error (``CorruptCheckpoint`` for checkpoint files, so the
previous checkpoint is used; :class:`UnsafeRunFile` otherwise), naming the file, what was found
and what is allowed. ``tests/test_architecture.py`` fails when code outside this module opens a
file or loads one (``open``, ``os.open``, ``torch.load``, ``fsspec.open``, ``fs.open``...).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "config.yaml")
    >>> write_bytes(path, b"trainer: {}\\n", CONFIG)
    >>> read_text(path, CONFIG)
    'trainer: {}\\n'
"""

from backends.checkpoint_io.run_files.archives import load_torch, load_torch_mapped, verify_archive
from backends.checkpoint_io.run_files.kinds import (
    CHECKPOINT,
    CONFIG,
    DCP_INDEX,
    DCP_SHARD,
    KINDS,
    LOCK,
    METRICS,
    PREDICTIONS,
    PROBE,
    RUN_ID,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    STATE,
    FileKind,
    UnsafeRunFile,
)
from backends.checkpoint_io.run_files.reading import (
    Filesystem,
    display,
    file_size,
    filesystem,
    is_local,
    list_entries,
    named_by_user,
    open_file,
    read_bytes,
    read_text,
)
from backends.checkpoint_io.run_files.writing import (
    ATOMIC_UPLOAD_PROTOCOLS,
    TEMPORARY_SUFFIX,
    Content,
    create_new,
    open_for_appending,
    temporary_name,
    write_bytes,
    write_file,
)

__all__ = [
    "ATOMIC_UPLOAD_PROTOCOLS",
    "CHECKPOINT",
    "CONFIG",
    "DCP_INDEX",
    "DCP_SHARD",
    "KINDS",
    "LOCK",
    "METRICS",
    "PREDICTIONS",
    "PROBE",
    "RUN_ID",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "STATE",
    "TEMPORARY_SUFFIX",
    "Content",
    "FileKind",
    "Filesystem",
    "UnsafeRunFile",
    "create_new",
    "display",
    "file_size",
    "filesystem",
    "is_local",
    "list_entries",
    "load_torch",
    "load_torch_mapped",
    "named_by_user",
    "open_file",
    "open_for_appending",
    "read_bytes",
    "read_text",
    "temporary_name",
    "verify_archive",
    "write_bytes",
    "write_file",
]
