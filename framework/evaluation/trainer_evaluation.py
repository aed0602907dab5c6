"""The trainer's evaluation entry points (``validate``, ``test``, ``predict``, ``best_checkpoint``,
the exports' weight loading), each able to load ``"best"``, ``"last"`` or a checkpoint's weights first.

A component the :class:`~framework.Trainer` holds as ``trainer.evaluation`` and delegates to; it is
given the few trainer values it needs, nothing else of the trainer.
"""

from typing import Any, Callable, Dict, List, Optional

from backends import TrainerBackend
from framework.callbacks.base import Callback
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.config.arguments import TrainerArguments
from framework.evaluation.loops import Evaluator
from framework.evaluation.prediction import Predictor
from framework.evaluation.weights import best_checkpoint_url, load_evaluation_weights
from framework.loop.stage import Stage
from framework.loop.training_state import TrainingProgress
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface, StepRunner


class TrainerEvaluation:
    """Evaluation outside training, for :class:`~framework.Trainer` (``trainer.evaluation``).

    Args:
        module, backend, checkpointer, args, evaluator, runner: the trainer's own.
        progress: the training counters (read: which step the metrics belong to).
        recorder: records the metrics and owns the loggers.
        callbacks: the trainer's callbacks (a checkpoint's weights reach a weight average).
        prepare_callbacks: hands the callbacks the trainer before a run of hooks.
        batch_size: the evaluation batch per process now (the micro-batch search may change it).
        resumed: whether the trainer restored a checkpoint (so its weights are known ones).
        before_first_write: called before an evaluation outside training starts the loggers while
            training never started (``RunClaim.note_evaluation``: where its files go); True when they go
            into the run this one continues and has not resumed yet (its files are appended to, never rewritten).

    Example:
        trainer.evaluation.validate(checkpoint="best")   # what trainer.validate(...) calls
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        backend: TrainerBackend,
        checkpointer: AbstractCheckpointer,
        args: TrainerArguments,
        evaluator: Evaluator,
        runner: StepRunner,
        progress: TrainingProgress,
        recorder: MetricRecorder,
        callbacks: List[Callback],
        prepare_callbacks: Callable[[], None],
        batch_size: Callable[[], int],
        resumed: Callable[[], bool],
        before_first_write: Callable[[], bool] = lambda: False,
    ) -> None:
        self.module, self.backend, self.checkpointer, self.args = module, backend, checkpointer, args
        self.evaluator, self.runner, self.progress, self.recorder = evaluator, runner, progress, recorder
        self.callbacks, self.prepare_callbacks, self.batch_size, self.resumed = callbacks, prepare_callbacks, batch_size, resumed
        self.before_first_write = before_first_write
        self.weights_loaded = False  # validate/test/predict loaded a checkpoint's weights

    def load_checkpoint_weights(self, checkpoint: Optional[str], method: str) -> Optional[str]:
        """What :meth:`framework.Trainer.load_checkpoint_weights` runs."""
        known = bool(self.progress.global_steps_finished) or self.resumed() or self.weights_loaded
        if checkpoint is not None:
            self.prepare_callbacks()  # a weight average exists to receive the checkpoint's
        url = load_evaluation_weights(self.module, self.checkpointer, self.backend, checkpoint, method, known, self.callbacks)
        self.weights_loaded = self.weights_loaded or url is not None  # later checkpoint=None calls use these
        return url

    def validate(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """What :meth:`framework.Trainer.validate` runs."""
        return self.evaluate(Stage.VAL, checkpoint)

    def test(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """What :meth:`framework.Trainer.test` runs."""
        return self.evaluate(Stage.TEST, checkpoint)

    def predict(self, checkpoint: Optional[str] = None, predictions_dir: Optional[str] = None) -> Any:
        """What :meth:`framework.Trainer.predict` runs."""
        self.load_checkpoint_weights(checkpoint, "predict")
        predictor = Predictor(self.module, self.backend, self.args, self.runner)
        return predictor.run(self.progress.global_steps_finished, self.batch_size(), predictions_dir)

    def best_checkpoint(self) -> Optional[str]:
        """What :meth:`framework.Trainer.best_checkpoint` runs."""
        return best_checkpoint_url(self.checkpointer, self.backend)

    def evaluate(self, stage: Stage, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """``stage``'s loaders once, outside training, with the loggers started and finished."""
        self.load_checkpoint_weights(checkpoint, "validate" if stage is Stage.VAL else "test")
        self.prepare_callbacks()
        # Training never started here: say where the files go (True: into the run this one continues, kept).
        keep_existing = not self.resumed() and self.before_first_write()
        self.recorder.start_loggers(keep_existing)
        try:  # no scheduler steps, no progress counters: this is not training
            return self.evaluator.run(stage, self.progress.global_steps_finished, self.batch_size())
        finally:
            self.recorder.loggers.finish()
