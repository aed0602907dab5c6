"""Shared storage, checked at start: every rank must see the same ``output_dir`` and ``save_dir``.

A run of several processes writes one set of files: rank zero writes metrics, the config and
whole checkpoints, every rank writes its shards into one checkpoint directory, and every rank
resumes from what it finds there. On several machines that holds only where the directory is
the same storage on every node (a shared filesystem, or an fsspec URL every node reaches).
Where it is each node's own disk, a sharded checkpoint is split across the nodes and a resume
reads different checkpoints on different ranks.

So before the first step :func:`check_shared_storage` proves it: rank zero writes a token
file (a random name and content) into each directory, every rank reads it back, and rank zero
removes it once every rank has read. A directory that any rank cannot read the token from
stops the run on every rank, before anything else is written, with a message naming the
directory, the ranks and hosts that do not see it, and what to do. One process, or a run that
writes and reads no checkpoint (only rank zero touches the disk): nothing to check.
"""

import logging
import socket
import time
import uuid
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

from backends.checkpoint_io import run_files
from framework.checkpoint import storage

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend
    from framework.checkpoint.abstract import AbstractCheckpointer

logger = logging.getLogger("framework")

TOKEN_PREFIX = ".storage-check-"
"""Names of the token files (``<directory>/.storage-check-<hex>``); each lives for the check only."""
READ_ATTEMPTS = (0.0, 0.1, 0.3, 0.6)
"""Seconds slept before each try to read the token: a network filesystem may show a new file late."""


class StorageNotShared(RuntimeError):
    """A directory of the run is not the same storage on every rank (each node its own disk).

    Example:
        >>> raise StorageNotShared("output_dir '/scratch/run' is not the same storage on every node: ...")
        Traceback (most recent call last):
        ...
        framework.run.shared_storage.StorageNotShared: output_dir '/scratch/run' is not the same storage on every node: ...
    """


def run_directories(output_dir: str, checkpointer: "AbstractCheckpointer") -> Dict[str, str]:
    """The directories every rank of the run must see alike, by the names messages give them.

    ``output_dir`` and the checkpointer's ``save_dir``, unless the run writes and reads no
    checkpoint at all (a :class:`~framework.checkpoint.DefaultCheckpointer` with
    ``period=0, save_every_n_steps=None, save_at_end=False`` and nothing to resume or load):
    then only rank zero touches the disk (metrics, config), and each node may keep its own.

    Example:
        >>> from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments
        >>> list(run_directories("runs/a", DefaultCheckpointer(default_dir="runs/a/checkpoints")))
        ['output_dir (--trainer.output_dir)', 'save_dir (--checkpointer.save_dir, by default <output_dir>/checkpoints)']
        >>> run_directories("runs/a", DefaultCheckpointer(DefaultCheckpointerArguments(period=0, save_at_end=False)))
        {}
    """
    from framework.checkpoint.arguments import DefaultCheckpointerArguments

    args = getattr(checkpointer, "args", None)
    if isinstance(args, DefaultCheckpointerArguments):
        used = (args.period, args.save_every_n_steps, args.save_at_end, args.resume, args.load_dir, args.load_filename)
        if not any(used):
            return {}
    directories = {"output_dir (--trainer.output_dir)": output_dir}
    if checkpointer.save_dir is not None:
        directories["save_dir (--checkpointer.save_dir, by default <output_dir>/checkpoints)"] = checkpointer.save_dir
    return directories


def check_shared_storage(directories: Mapping[str, str], backend: "TrainerBackend") -> None:
    """Refuse to start unless every rank sees each of ``directories`` as the same storage.

    Call on every rank, before anything is written. Each directory is created where missing.

    Args:
        directories: what each directory is called in messages (``"output_dir (--trainer.output_dir)"``)
            -> its local path or fsspec URL.
        backend: the run's backend (its collectives carry the tokens' names and the verdicts).

    Raises:
        StorageNotShared: on every rank, when some rank cannot read what rank zero wrote.

    Example:
        check_shared_storage({"output_dir (--trainer.output_dir)": args.output_dir}, trainer.backend)
    """
    if backend.world_size == 1 or not directories:
        return
    tokens: Dict[str, Tuple[str, str]] = backend.run_on_rank_zero(
        lambda: _write_tokens(directories), "could not write into the run's directories"
    )
    seen = {label: _read_token(location, *tokens[label]) for label, location in directories.items()}
    everyone: List[Tuple[str, Dict[str, Optional[str]]]] = backend.all_gather_object((socket.gethostname(), seen))
    if backend.is_main_process:  # every rank has read: the tokens go
        for label, location in directories.items():
            _remove_quietly(location, tokens[label][0])
    problems = [
        _describe(label, directories[label], tokens[label][0], everyone)
        for label in directories
        if any(verdicts[label] is not None for _, verdicts in everyone)
    ]
    if problems:
        raise StorageNotShared(
            "; ".join(problems) + ". Every rank reads and writes the same files there (sharded checkpoints, resume): "
            "put it on a shared filesystem that every node mounts at the same path, or give an fsspec URL that every "
            "node reaches (s3://bucket/run, gs://...); see docs/many-machines.md"
        )
    logger.debug("storage check: %s the same on all %d ranks", ", ".join(directories.values()), backend.world_size)


def _write_tokens(directories: Mapping[str, str]) -> Dict[str, Tuple[str, str]]:
    """Rank zero: a token file in each directory; ``{label: (file name, content)}``."""
    written = {}
    for label, location in directories.items():
        fs, directory = storage.resolve(location)
        fs.makedirs(directory, exist_ok=True)
        name, content = f"{TOKEN_PREFIX}{uuid.uuid4().hex}", uuid.uuid4().hex
        run_files.write_file(fs, storage.join(directory, name), content.encode())
        written[label] = (name, content)
    return written


def _read_token(location: str, name: str, content: str) -> Optional[str]:
    """None when ``location/name`` holds ``content`` here, else what this rank found instead."""
    fs, directory = storage.resolve(location)
    path = storage.join(directory, name)
    found = "it is not there"
    for delay in READ_ATTEMPTS:
        time.sleep(delay)
        try:
            fs.invalidate_cache(directory)
            text = run_files.read_text(fs, path, run_files.PROBE)
        except FileNotFoundError:
            continue
        except (OSError, run_files.UnsafeRunFile) as error:
            found = f"{type(error).__name__}: {error}"
            continue
        if text == content:
            return None
        found = "another file is there under its name"
    return found


def _remove_quietly(location: str, name: str) -> None:
    fs, directory = storage.resolve(location)
    try:
        fs.rm(storage.join(directory, name))
    except OSError as error:  # a leftover token harms nothing
        logger.debug("could not remove the storage check file %s: %s", name, error)


def _describe(label: str, location: str, name: str, everyone: List[Tuple[str, Dict[str, Optional[str]]]]) -> str:
    """``output_dir '/x' is not the same storage on every node: rank 0 (host a) wrote ..., rank 1 (host b) ...``."""
    missing = [
        f"rank {rank} (host {host}): {verdicts[label]}" for rank, (host, verdicts) in enumerate(everyone) if verdicts[label]
    ]
    return (
        f"{label} {location!r} is not the same storage on every node: rank 0 (host {everyone[0][0]}) wrote the file "
        f"{name} there and the other ranks read it back, but not {', '.join(missing)}"
    )
