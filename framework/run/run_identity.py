"""Run identity: every run has an id, kept in a record of its own (``<output_dir>/run_id``: 32
hex digits, read without parsing anything else), in ``config.yaml`` and in every checkpoint.

A fresh run draws a new id; a run that resumes keeps the id of the run it continues. The id
answers "whose checkpoint is this?": ``resume="auto"`` only continues from checkpoints of
the run that lives in ``output_dir`` (its ``config.yaml`` names it), so a checkpoint copied
in from another run, or a ``save_dir`` mixed up with another run's, is refused by name
(:class:`ForeignCheckpoint`). A checkpoint the user names (``load_dir``/``load_filename``,
fine-tuning) may come from any run: that is logged. Checkpoints written before run ids
existed carry none and load as before. torchrun restarts of one job share the
``config.yaml`` and so the id: they resume their own files.

A checkpoint also records the ``output_dir`` of the run that wrote it (:data:`OUTPUT_DIR_KEY`).
Two runs with two output directories and one ``save_dir``: the second, resuming, would adopt
the first's checkpoints (and its retention delete them). It is refused
(:class:`ForeignCheckpoint`) while the first's ``output_dir`` still holds that run (its
``config.yaml`` names the checkpoint's run id); once that directory is gone, its checkpoints
may be continued from another ``output_dir``.
"""

import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from backends import TrainerBackend

logger = logging.getLogger("framework")

RUN_ID_KEY = "run_id"
"""The key of the run id in ``config.yaml`` (top level) and in the trainer's checkpoint state."""
RUN_ID_FILE = "run_id"
"""The run's id alone, in ``output_dir`` (runs written before it existed keep theirs in ``config.yaml`` only)."""
UNREADABLE = "<unreadable>"
"""What :func:`recorded_run_id` answers for a record that is there but cannot be read: whose run
it is is unknown, and unknown never lets another run adopt its files."""
OUTPUT_DIR_KEY = "output_dir"
"""The key of the writing run's absolute ``output_dir`` in the trainer's checkpoint state."""


class ForeignCheckpoint(ValueError):
    """``resume="auto"`` found a checkpoint of another run; the message names both runs and the ways on.

    Example:
        >>> raise ForeignCheckpoint("checkpoint runs/a/checkpoint-000000005.pt belongs to run 1f2e..., ...")
        Traceback (most recent call last):
        ...
        framework.run.run_identity.ForeignCheckpoint: checkpoint runs/a/checkpoint-000000005.pt belongs to run 1f2e..., ...
    """


def new_run_id() -> str:
    """A new run id: 32 hex digits (``uuid4``).

    Example:
        >>> len(new_run_id())
        32
    """
    return uuid.uuid4().hex


def write_run_record(output_dir: str, run_id: str) -> None:
    """Write ``<output_dir>/run_id`` (atomically; call on rank zero).

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> write_run_record(directory, "ab" * 16); recorded_run_id(directory) == "ab" * 16
        True
    """
    from backends.checkpoint_io import run_files  # the one door for files

    run_files.write_bytes(os.path.join(output_dir, RUN_ID_FILE), f"{run_id}\n".encode(), run_files.RUN_ID)


def recorded_run_id(output_dir: str) -> Optional[str]:
    """The id of the run living in ``output_dir``: its ``run_id`` record (else, for a run written
    before records existed, ``config.yaml``'s ``run_id``); None when neither file is there or
    ``config.yaml`` names no id; :data:`UNREADABLE` when a file is there but cannot be read.

    Example:
        >>> import tempfile
        >>> recorded_run_id(tempfile.mkdtemp()) is None
        True
    """
    from backends.checkpoint_io import run_files  # the one door for files

    try:
        text = run_files.read_text(os.path.join(output_dir, RUN_ID_FILE), run_files.RUN_ID).strip()
        return text if re.fullmatch("[0-9a-f]{32}", text) else UNREADABLE
    except FileNotFoundError:
        pass
    except (OSError, run_files.UnsafeRunFile):
        return UNREADABLE
    try:
        text = run_files.read_text(os.path.join(output_dir, "config.yaml"), run_files.CONFIG)
    except FileNotFoundError:
        return None
    except (OSError, run_files.UnsafeRunFile):
        return UNREADABLE
    from framework.config.bounded_yaml import YamlRefused, load_yaml  # only when there is a file

    try:
        data = load_yaml(text)  # an alias bomb is refused, not walked
    except (YamlRefused, ValueError):
        return UNREADABLE
    value = data.get(RUN_ID_KEY) if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


@dataclass
class StartingIdentity:
    """What a run knows of its id before it loads a checkpoint.

    Attributes:
        recorded: the id in ``output_dir``'s ``config.yaml`` (the run living there), or None.
        fresh: a new id, used when the run continues no run.

    Example:
        >>> StartingIdentity(recorded=None, fresh="ab" * 16).after_load(None, automatic=False, path=None) == "ab" * 16
        True
    """

    recorded: Optional[str]
    fresh: str
    output_dir: Optional[str] = None

    @classmethod
    def read(cls, output_dir: str, backend: "TrainerBackend") -> "StartingIdentity":
        """Rank zero reads ``config.yaml`` and draws the fresh id; every rank gets the same (call on every rank)."""
        found: Optional[Tuple[Optional[str], str]] = None
        if backend.is_main_process:
            found = (recorded_run_id(output_dir), new_run_id())
        found = backend.broadcast_object(found)  # a no-op on one rank
        if found is None:
            raise RuntimeError("rank zero sent no run id")
        if found[0] == UNREADABLE:  # every rank raises: rank zero sent the verdict
            raise ForeignCheckpoint(
                f"output_dir {output_dir!r} holds a run whose id cannot be read (its {RUN_ID_FILE} or config.yaml is "
                "damaged, too large or not a regular file), so which checkpoints are its own is unknown. Restore or "
                f"remove {os.path.join(output_dir, RUN_ID_FILE)} to continue it, or choose another output_dir"
            )
        return cls(found[0], found[1], output_dir=os.path.abspath(output_dir))

    def after_load(self, saved: Optional[str], automatic: bool, path: Optional[str], saved_output_dir: Any = None) -> str:
        """This run's id once the checkpoint (if any) is chosen.

        Args:
            saved: the run id in the loaded checkpoint (None: no checkpoint, or one written
                before run ids existed).
            automatic: True when ``resume="auto"`` found the checkpoint in this run's own
                ``save_dir``; False when the user named it (``load_dir``/``load_filename``).
            path: where the checkpoint was read from, for messages.
            saved_output_dir: the ``output_dir`` of the run that wrote it (None: not recorded).

        Raises:
            ForeignCheckpoint: ``automatic`` and the checkpoint belongs to another run than
                the one ``config.yaml`` names, or to a run that still lives in another ``output_dir``.
        """
        own = self.recorded or self.fresh
        if saved is None:
            return own
        if automatic and self.recorded is None and isinstance(saved_output_dir, str) and self.output_dir is not None:
            elsewhere = os.path.realpath(saved_output_dir) != os.path.realpath(self.output_dir)
            if elsewhere and recorded_run_id(saved_output_dir) in (saved, UNREADABLE):  # unknown is not "gone"
                raise ForeignCheckpoint(
                    f"resume='auto' found checkpoint {path} of run {saved}, which lives (or may live: its record may be "
                    f"unreadable) in output_dir "
                    f"{saved_output_dir!r}, not in this run's output_dir {self.output_dir!r}: two runs share one save_dir. "
                    "Resuming would adopt that run's checkpoints and this run's retention would delete them. To continue "
                    f"that run, use its output_dir (--trainer.output_dir {saved_output_dir}); to start another run, choose "
                    "another save_dir (--checkpointer.save_dir)"
                )
        if automatic:
            if self.recorded is not None and saved != self.recorded:
                raise ForeignCheckpoint(
                    f"resume='auto' found checkpoint {path}, which belongs to run {saved}, but this output_dir holds "
                    f"run {self.recorded} (its config.yaml): a file copied in from another run, or save_dir pointing "
                    "at another run's checkpoints. Move that checkpoint away to continue this run from its own; to "
                    "start from it on purpose, name it: --checkpointer.load_filename PATH (fine-tuning, with "
                    "--checkpointer.reset_optimizers_schedulers true for fresh optimizers) in a new output_dir"
                )
            return saved
        if saved != own:
            logger.info("run %s starts from checkpoint %s of run %s (named by load_dir/load_filename)", own, path, saved)
        return own
