"""A run's claim on its directories: it moves to ``version_<N>`` when another run's files are in
``output_dir``, holds the lock that keeps a second live run out (and stops this one when the lock
is taken over), and checks the directories before anything is written.

A component the :class:`~framework.Trainer` holds as ``trainer.run_claim``; it is given the few
trainer values it needs, nothing else of the trainer. The pieces it calls live beside it:
:mod:`framework.run.run_directory`, :mod:`framework.run.run_lock`, :mod:`framework.run.shared_storage`.
"""

import logging
import os
from typing import Callable, Optional

from backends import TrainerBackend
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.default import DefaultCheckpointer
from framework.config.arguments import TrainerArguments
from framework.run.run_directory import choose_run_directory, claim_run_directory, locked_directories, previous_run_files
from framework.run.run_lock import RunLockLost, RunLocks, claim_run_lock
from framework.run.shared_storage import check_shared_storage, run_directories

logger = logging.getLogger("framework")


class RunClaim:
    """One live run per directory, for :class:`~framework.Trainer` (``trainer.run_claim``).

    Every method is collective under DDP: call it on every rank.

    Args:
        args: the trainer's own copy of the arguments (``output_dir`` may move to ``version_<N>``).
        checkpointer: its default directory moves with ``output_dir``; its ``save_dir`` is locked too.
        backend: the ranks that agree on each verdict.
        on_lost: called (from the lock's heartbeat thread) when another run takes the lock over;
            the trainer stops at its next step boundary, as on a signal.

    Example:
        claim = RunClaim(args=args, checkpointer=checkpointer, backend=backend, on_lost=lambda: print("lock lost"))
        claim.move_if_taken()     # output_dir holds another run: this one writes to version_<N>
        claim.lock()              # a second live run on these directories is refused here
        claim.check()             # before each write: raises RunLockLost once the lock was taken over
        claim.release()
    """

    def __init__(
        self,
        *,
        args: TrainerArguments,
        checkpointer: AbstractCheckpointer,
        backend: TrainerBackend,
        on_lost: Callable[[], None],
    ) -> None:
        self.args, self.checkpointer, self.backend, self.on_lost = args, checkpointer, backend, on_lost
        self.locks: Optional[RunLocks] = None
        """Rank zero's locks while training runs (None on the other ranks and between runs)."""
        self.evaluated_first: Optional[bool] = None
        """Whether ``output_dir`` held no run's files when an evaluation before training first wrote
        there (None: no such evaluation); True makes those files this run's own."""
        self.evaluates_continued_run = False
        """An evaluation outside training writes into the run this one continues, not yet resumed."""

    def note_evaluation(self) -> bool:
        """Before ``validate()``/``test()`` outside training writes its first file: decide where it writes.

        A free ``output_dir`` becomes this run's: a ``train()`` after it continues there (one run, one
        directory) instead of moving to ``version_<N>`` away from its own evaluation. One that holds
        another run this run does not continue is never written into: the evaluation, and a ``train()``
        after it, move to ``version_<N>`` as a training run would (``output_dir_in_use="error"``
        refuses). Collective: call it on every rank.

        Returns:
            True when ``output_dir`` holds the run this one continues (``resume="auto"``) and training
            has not resumed it yet: the evaluation appends to that run's files instead of rewriting them.
        """
        if self.evaluated_first is None and not self.args.fast_dev_run:
            output_dir, checkpointer = self.args.output_dir, self.checkpointer
            free, continues = self.backend.run_on_rank_zero(
                lambda: (not previous_run_files(output_dir), checkpointer.continues_existing_run()),
                "failed to look at output_dir",
            )
            self.evaluates_continued_run = not free and continues
            if not free and not continues:
                if not self.move_if_taken():  # output_dir_in_use="error"
                    claim_run_directory(output_dir, checkpointer, self.backend)  # raises RunDirectoryInUse
                if self.backend.is_main_process:  # give back version_<N>'s reserved lock: train() takes it again
                    claim_run_lock(self.args.output_dir, None).release()  # type: ignore[union-attr]
                free = True
            self.evaluated_first = bool(free)
        return self.evaluates_continued_run

    def move_if_taken(self) -> bool:
        """Move ``args.output_dir`` to ``<output_dir>/version_<N>`` when it holds another run this run
        does not continue (and say so once); True when it moved."""
        args = self.args
        if self.evaluated_first:  # the files there are this run's own evaluation's
            return False
        chosen = choose_run_directory(args.output_dir, args.output_dir_in_use, self.checkpointer, self.backend)
        if chosen == args.output_dir:
            return False
        logger.warning(
            "output_dir %s holds another run: this run writes to %s (--checkpointer.resume auto continues the run "
            "there instead; --trainer.output_dir_in_use error refuses)",
            args.output_dir,
            chosen,
        )
        args.output_dir = chosen  # the trainer's own copy of the arguments
        if isinstance(self.checkpointer, DefaultCheckpointer):
            self.checkpointer.use_default_dir(os.path.join(chosen, "checkpoints"))
        return True

    def lock(self) -> None:
        """Check that every rank sees the same directories, then take their locks on rank zero; a lock
        taken over later calls ``on_lost``."""
        output_dir = self.args.output_dir
        check_shared_storage(run_directories(output_dir, self.checkpointer), self.backend)
        self.locks = claim_run_lock(output_dir, self.backend, locked_directories(output_dir, self.checkpointer))
        if self.locks is not None:
            self.locks.on_lost(self.on_lost)

    def claim_directory(self) -> None:
        """Before anything is written: refuse an ``output_dir`` with another run's files (unless this
        run continues it) and let the checkpointer prepare its directory."""
        claim_run_directory(self.args.output_dir, self.checkpointer, self.backend, own_files=bool(self.evaluated_first))

    def check(self) -> None:
        """Raise :class:`RunLockLost` on every rank when rank zero's lock was taken over (before any write)."""
        problem = None
        if self.locks is not None:
            try:
                self.locks.check()
            except RunLockLost as error:
                problem = str(error)
        if self.backend.world_size > 1:
            problem = self.backend.broadcast_object(problem)
        if problem is not None:
            raise RunLockLost(problem)

    def release(self) -> None:
        """Remove the locks (training ended, by an error too)."""
        if self.locks is not None:
            self.locks.release()
            self.locks = None
