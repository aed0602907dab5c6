"""What :meth:`~framework.Trainer.train` does before its first step, in order, and the notes it logs then.

:class:`RunStart` is a component the trainer holds as ``trainer.run_start``; it is given the parts
it calls, by keyword, and not the trainer (handing callbacks the trainer is ``prepare_callbacks``).
"""

import logging
import os
from typing import Callable, List

from backends import TrainerBackend
from backends.environments import LocalEnvironment
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.config.arguments import TrainerArguments
from framework.config.cli import resolved_config
from framework.loop.checkpoint_manager import CheckpointManager
from framework.loop.stopping import StopConditions
from framework.loop.training_setup import TrainingSetup
from framework.loop.training_state import TrainingProgress
from framework.metrics.background_plot import lower_pending_priority
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface
from framework.run.finished_run import changed_settings, log_nothing_to_do
from framework.run.run_claim import RunClaim
from framework.run.run_identity import write_run_record

logger = logging.getLogger("framework")


class RunStart:
    """Sets a run up before its first step (``trainer.run_start``); :meth:`run` is the sequence.

    Args:
        module, args, backend, checkpointer: the trainer's own.
        progress: the training counters (a resumed run that is already complete says so).
        prepare_callbacks: hands the callbacks the trainer and looks the hooks up afresh.
        setup: builds what the step runs on, and searches the micro-batch.
        checkpoint_manager: restores the checkpoint the checkpointer finds.
        run_claim: the run's directories: ``version_<N>``, the lock, the check before writing.
        recorder: starts the loggers (it owns them: they move with ``output_dir``).
        stopping: its clock starts here; a resumed run that is already complete says so.

    Example:
        trainer.run_start.run()        # what train() calls first
        trainer.run_start.started      # True once a train() call has set the run up (and restored)
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        args: TrainerArguments,
        backend: TrainerBackend,
        checkpointer: AbstractCheckpointer,
        progress: TrainingProgress,
        prepare_callbacks: Callable[[], None],
        setup: TrainingSetup,
        checkpoint_manager: CheckpointManager,
        run_claim: RunClaim,
        recorder: MetricRecorder,
        stopping: StopConditions,
    ) -> None:
        self.module, self.args, self.backend, self.checkpointer = module, args, backend, checkpointer
        self.progress, self.prepare_callbacks, self.setup = progress, prepare_callbacks, setup
        self.checkpoint_manager, self.run_claim, self.recorder, self.stopping = checkpoint_manager, run_claim, recorder, stopping
        self.started = False

    def run(self) -> None:
        """Claim the directories and build (each call); restore and search (the first call only);
        then start the loggers, write ``config.yaml`` and start the clock."""
        args, first_start = self.args, not self.started
        lower_pending_priority()  # an earlier run's metrics.png drawing yields the CPU to this run
        if not args.fast_dev_run:  # another run's output_dir: train in version_<N>; a second live run stops here
            if first_start:
                self.run_claim.move_if_taken()  # the recorder's loggers follow output_dir when they start
            self.run_claim.lock()  # a lock taken over by another run stops this one at its next step
        self.setup.build()  # loader, wrapped module, optimizers, the step
        self.prepare_callbacks()
        if first_start:
            self.started = True
            log_run_start(args, self.backend, self.checkpointer)  # checkpoint retention; ddp as one process
            if not args.fast_dev_run:
                self.setup.warn_if_not_resumable()
                self.run_claim.claim_directory()  # before anything is written: never overwrite another run's files
            self.checkpoint_manager.restore()  # sets run_id: the resumed run's, or a new one
            self.setup.search_micro_batch()  # gpu_batch_size_limit="auto", unless the checkpoint gave it
        self.recorder.start_loggers()
        if self.backend.is_main_process and not args.fast_dev_run:
            self._write_config()
        self.stopping.start_clock()
        self.module.train()

    def _write_config(self) -> None:
        """``config.yaml``, with the run's id; first, when the loaded checkpoint already finished the
        run, say so (and which settings changed since)."""
        args, steps, epochs = self.args, self.progress.global_steps_finished, self.progress.epochs_finished
        path, config = os.path.join(args.output_dir, "config.yaml"), resolved_config(args)
        if self.checkpointer.loaded_from is not None and self.stopping.complete(epochs, steps):
            log_nothing_to_do(steps, epochs, changed_settings(path, config.to_dict()))  # before config.yaml is rewritten
        if self.checkpoint_manager.run_id is not None:
            write_run_record(args.output_dir, self.checkpoint_manager.run_id)
        config.save(path, run_id=self.checkpoint_manager.run_id)


def run_start_notes(args: TrainerArguments, backend: TrainerBackend, checkpointer: AbstractCheckpointer) -> List[str]:
    """The lines :func:`log_run_start` writes (every rank computes them; nothing collective).

    - what the checkpointer writes and keeps (``AbstractCheckpointer.describe``), unless
      checkpointing is off (``fast_dev_run``);
    - that a multi-process backend (``ddp``...) runs as one process, when it was started
      without a launcher or with a world size of 1.
    """
    notes = []
    if not args.fast_dev_run:  # checkpointing is on
        description = checkpointer.describe()
        if description:
            notes.append(description)
    if backend.multi_process and backend.world_size == 1:
        environment = backend.cluster_environment
        how = (
            "not launched by torchrun/srun"
            if isinstance(environment, LocalEnvironment)
            else f"{environment.launcher} started a world size of 1"
        )
        notes.append(f"{args.backend} backend with one process ({how}): training as a single process")
    return notes


def log_run_start(args: TrainerArguments, backend: TrainerBackend, checkpointer: AbstractCheckpointer) -> None:
    """Log :func:`run_start_notes` at INFO on rank zero."""
    if backend.is_main_process:
        for note in run_start_notes(args, backend, checkpointer):
            logger.info("%s", note)
