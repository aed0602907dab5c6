"""One run per directory: a new run never writes where another run's files are.

A local ``save_dir`` is locked with the output directory while the run lives, inside it or not
(:func:`locked_directories`, :mod:`framework.run.run_lock`);
whose checkpoints it holds is checked on resume (:mod:`framework.run.run_identity`).

Running the same command twice without ``resume`` would otherwise overwrite the first run's
``metrics.csv``, ``config.yaml`` and checkpoints. At setup, before anything is written,
:func:`choose_run_directory` moves a new run whose ``output_dir`` holds another run to
``<output_dir>/version_<N>`` (``output_dir_in_use="new_version"``, the default, as Lightning's
``version_N``; the directory is chosen and locked in one step, so two reruns started together
take two versions), then :func:`claim_run_directory` checks ``output_dir``
(:func:`check_output_dir_free`) and the checkpointer's own directory
(``AbstractCheckpointer.prepare_run``): a run that continues the run already there
(``resume="auto"``, or loading from its own ``save_dir``) may use them; any other is refused.
"""

import os
import re
from typing import TYPE_CHECKING, Any, List, Tuple

from backends.checkpoint_io.local_files import local_path
from framework.run.run_lock import claim_run_lock, reserve_directory

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend
    from framework.checkpoint.abstract import AbstractCheckpointer

RUN_FILES = ("metrics.csv", "config.yaml", "run_id")
"""Files a run writes into ``output_dir``; finding one means another run lives there."""

RUN_ENTRY = re.compile(r"^(checkpoint|model)-\d+(\.pt)?(\.stale)?$")
"""Names of a run's checkpoints (files, or directories of shards), model exports and their
``.stale`` renames in its checkpoint directory."""


class RunDirectoryInUse(FileExistsError):
    """A new run would overwrite another run's files; the message names the directory and the ways on.

    Example:
        >>> raise RunDirectoryInUse("output_dir 'runs/exp1' already holds another run's files (metrics.csv) ...")
        Traceback (most recent call last):
        ...
        framework.run.run_directory.RunDirectoryInUse: output_dir 'runs/exp1' already holds another run's files (metrics.csv) ...
    """


def ways_on(new_location: str) -> str:
    """The sentence telling a refused user how to continue the old run or start a new one."""
    return (
        "to continue that run, resume it: --checkpointer.resume auto (checkpointer_args.resume='auto'); "
        f"to start a new run, choose another {new_location}"
    )


def previous_run_files(output_dir: str) -> List[str]:
    """Files of a previous run in ``output_dir`` (relative names; empty when there are none).

    Example:
        >>> import tempfile
        >>> previous_run_files(tempfile.mkdtemp())
        []
    """
    found = [name for name in RUN_FILES if os.path.isfile(os.path.join(output_dir, name))]
    checkpoints = os.path.join(output_dir, "checkpoints")
    if os.path.isdir(checkpoints):
        names = sorted(name for name in os.listdir(checkpoints) if RUN_ENTRY.match(name))
        found += [f"checkpoints/{name}" for name in names]
    return found


def check_output_dir_free(output_dir: str, resuming: bool) -> None:
    """Refuse to start a run in ``output_dir`` when it holds another run's files.

    Args:
        output_dir: the run's output directory (``TrainerArguments.output_dir``).
        resuming: True when this run continues the run already in the directory (then its
            files are this run's own and may be rewritten).

    Raises:
        RunDirectoryInUse: ``output_dir`` holds ``metrics.csv``, ``config.yaml`` or checkpoints
            and ``resuming`` is False.

    Example:
        >>> import tempfile
        >>> check_output_dir_free(tempfile.mkdtemp(), resuming=False)  # empty: free
    """
    if resuming:
        return
    found = previous_run_files(output_dir)
    if found:
        shown = ", ".join(found[:4]) + (f", ... ({len(found)} files)" if len(found) > 4 else "")
        raise RunDirectoryInUse(
            f"output_dir {output_dir!r} already holds another run's files ({shown}) and this run does not resume "
            f"it, so it would overwrite them; {ways_on('output_dir (--trainer.output_dir)')}"
        )


def free_version_dir(output_dir: str, reserve: bool = False) -> str:
    """``<output_dir>/version_<N>`` for the first N >= 1 that holds no run's files (and, with
    ``reserve``, whose run lock this process could take: chosen and locked in one step, the lock
    kept for :func:`~framework.run.run_lock.claim_run_lock` to adopt).

    Example:
        >>> import tempfile
        >>> os.path.basename(free_version_dir(tempfile.mkdtemp()))
        'version_1'
    """
    version = 1
    while True:
        candidate = os.path.join(output_dir, f"version_{version}")
        if not previous_run_files(candidate) and (not reserve or _reserve(candidate)):
            return candidate
        version += 1


def _reserve(candidate: str) -> bool:
    """Lock ``candidate`` for this run; False when a live run holds it or wrote its files meanwhile."""
    if not reserve_directory(candidate):
        return False
    if previous_run_files(candidate):  # a run that took it and ended between the look and the lock
        claim_run_lock(candidate, None).release()  # type: ignore[union-attr]
        return False
    return True


def choose_run_directory(output_dir: str, in_use: str, checkpointer: "AbstractCheckpointer", backend: "TrainerBackend") -> str:
    """The directory a new training run writes to: ``output_dir``, or with ``in_use="new_version"``
    a free ``<output_dir>/version_<N>`` when ``output_dir`` holds another run this run does not
    continue. Decided on rank zero, returned on every rank (call it on every rank).

    Example:
        run_dir = choose_run_directory(args.output_dir, args.output_dir_in_use, trainer.checkpointer, trainer.backend)
    """

    def choose() -> str:
        if in_use != "new_version" or checkpointer.continues_existing_run() or not previous_run_files(output_dir):
            return output_dir
        return free_version_dir(output_dir, reserve=True)

    return backend.run_on_rank_zero(choose, "failed to choose the run directory")


def claim_run_directory(
    output_dir: str, checkpointer: "AbstractCheckpointer", backend: "TrainerBackend", own_files: bool = False
) -> None:
    """At setup, before anything is written: check ``output_dir`` and the checkpointer's directory.

    Rank zero (the rank that writes) runs :func:`check_output_dir_free` with
    ``checkpointer.continues_existing_run()`` and then ``checkpointer.prepare_run()``; its
    outcome is shared (``backend.run_on_rank_zero``), so every rank raises together instead
    of waiting in a collective. Call it on every rank. ``own_files``: the files in ``output_dir``
    are this run's own (its ``validate()`` before ``train()`` wrote them into a free directory).

    Raises:
        RunDirectoryInUse: on rank zero, as raised there; on the other ranks, with its message.

    Example:
        claim_run_directory(args.output_dir, trainer.checkpointer, trainer.backend)
    """

    def claim() -> None:
        check_output_dir_free(output_dir, own_files or checkpointer.continues_existing_run())
        checkpointer.prepare_run()

    backend.run_on_rank_zero(claim, "refused to start the run", share_as=(RunDirectoryInUse,))


def locked_directories(output_dir: str, checkpointer: Any) -> List[Tuple[str, str]]:
    """``[(save_dir, "save_dir")]`` when the checkpointer's ``save_dir`` is a local directory
    other than ``output_dir``, inside it or not (the run locks it too: another run pointed at it
    finds it held), else empty. Aliases of one directory (a link, ``..``) are one directory.

    Example:
        >>> class Checkpointer:
        ...     save_dir = "/runs/shared-checkpoints"
        >>> locked_directories("/runs/a", Checkpointer()), locked_directories("/runs/shared-checkpoints", Checkpointer())
        ([('/runs/shared-checkpoints', 'save_dir')], [])
        >>> locked_directories("/runs/shared-checkpoints/..", Checkpointer())
        [('/runs/shared-checkpoints', 'save_dir')]
    """
    save_dir = getattr(checkpointer, "save_dir", None)
    local, output = (local_path(str(save_dir)) if save_dir else None), local_path(str(output_dir))
    if local is None or output is None or os.path.realpath(local) == os.path.realpath(output):
        return []
    return [(local, "save_dir")]
