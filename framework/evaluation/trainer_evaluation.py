"""``validate``, ``test``, ``predict``, ``best_checkpoint`` and the exports of the trainer, each able
to load ``"best"``, ``"last"`` or a checkpoint's weights first.

Kept apart from the loop in :mod:`framework.loop.trainer`, which inherits :class:`TrainerEvaluation`.
"""

from typing import Any, Dict, List, Optional, Tuple, Union

from backends import TrainerBackend
from framework import export
from framework.callbacks.base import Callback
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.evaluation.loops import Evaluator
from framework.evaluation.prediction import Predictor
from framework.evaluation.weights import best_checkpoint_url, load_evaluation_weights
from framework.loggers import LoggerSet
from framework.loop.schedulers import LRSchedules
from framework.loop.stage import Stage
from framework.loop.training_state import TrainingProgress
from framework.metrics.collector import MetricHistory
from framework.metrics.recorder import MetricRecorder
from framework.module import ModuleInterface, StepRunner
from framework.run.arguments import TrainerArguments


class TrainerEvaluation:
    """Evaluation entry points of :class:`~framework.Trainer` (which sets every attribute below).

    Example:
        trainer.validate(checkpoint="best")
        trainer.predict(predictions_dir="outputs/predictions")
    """

    args: TrainerArguments
    module: ModuleInterface
    backend: TrainerBackend
    checkpointer: AbstractCheckpointer
    history: MetricHistory
    loggers: LoggerSet
    progress: TrainingProgress
    recorder: MetricRecorder
    evaluator: Evaluator
    lr_schedules: LRSchedules
    automatic_optimization: bool
    train_step_batch_size: int
    _restored: bool
    _weights_loaded: bool
    _runner: StepRunner
    callbacks: List[Callback]

    def _prepare_callbacks(self) -> None:  # defined by Trainer
        raise NotImplementedError

    def load_checkpoint_weights(self, checkpoint: Optional[str], method: str) -> Optional[str]:
        """Load the weights ``checkpoint`` names (None: keep the current ones; ``"best"``, ``"last"``,
        a path) on every rank; the URL loaded. ``method`` names the caller in messages."""
        known = bool(self.progress.global_steps_finished) or self._restored or self._weights_loaded
        if checkpoint is not None:
            self._prepare_callbacks()  # a weight average exists to receive the checkpoint's
        url = load_evaluation_weights(self.module, self.checkpointer, self.backend, checkpoint, method, known, self.callbacks)
        self._weights_loaded = self._weights_loaded or url is not None  # later checkpoint=None calls use these
        return url

    def validate(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the validation loaders once; return the recorded metrics.

        ``checkpoint``: None evaluates the current weights; ``"last"``, ``"best"`` or a path
        loads those weights first, the same file on every rank (see ``docs/evaluation.md``).
        """
        return self._standalone_evaluation(Stage.VAL, checkpoint)

    def test(self, checkpoint: Optional[str] = None) -> Dict[str, float]:
        """Run the test loaders once; return the recorded metrics (``checkpoint`` as in :meth:`validate`)."""
        return self._standalone_evaluation(Stage.TEST, checkpoint)

    def predict(self, checkpoint: Optional[str] = None, predictions_dir: Optional[str] = None) -> Any:
        """Run ``predict_step`` on every sample of ``get_predict_dataloader`` once across ranks.

        Rank zero returns the outputs in dataset order (the other ranks None); with
        ``predictions_dir`` every rank writes its batches there as it goes and rank zero returns
        the directory (read it with :func:`framework.evaluation.prediction.load_predictions`).
        ``checkpoint`` as in :meth:`validate`. Collective under DDP: call it on every rank.
        """
        self.load_checkpoint_weights(checkpoint, "predict")
        batch_size = self.args.val_batch_size or self.train_step_batch_size
        predictor = Predictor(self.module, self.backend, self.args, self._runner)
        return predictor.run(self.progress.global_steps_finished, batch_size, predictions_dir)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``checkpointer_args.metric``, on every rank (collective under DDP)."""
        return best_checkpoint_url(self.checkpointer, self.backend)

    def export_weights(self, path: str, checkpoint: Optional[str] = None, max_shard_size: Union[int, str, None] = None) -> str:
        """Write the module's ``state_dict()`` as ``.safetensors`` (sharded above ``max_shard_size``,
        e.g. ``"5GB"``) or ``.pt`` on rank zero; return where it went. ``checkpoint`` as in
        :meth:`validate`; under fsdp the shards are gathered. Collective: call on every rank
        (see ``docs/export.md``)."""
        return export.export_weights(self, path, checkpoint, max_shard_size)

    def export_pretrained(
        self,
        directory: str,
        attribute: Optional[str] = None,
        checkpoint: Optional[str] = None,
        max_shard_size: Union[int, str, None] = "5GB",
    ) -> str:
        """Write the module's ``transformers`` model as ``save_pretrained`` does (its own keys,
        ``config.json``, HF's shard names), so ``from_pretrained(directory)`` loads it; return
        ``directory``. Collective: call on every rank (see ``docs/from-transformers.md``)."""
        from framework.integrations.transformers import export_pretrained

        return export_pretrained(self, directory, attribute, checkpoint, max_shard_size)

    def export(
        self, path: str, example_inputs: Tuple[Any, ...], format: str = "torch.export", checkpoint: Optional[str] = None
    ) -> str:
        """Export the module's ``forward`` for inference: ``"torch.export"`` (a ``.pt2`` program) or
        ``"onnx"``, traced with ``example_inputs``, on rank zero; ``checkpoint`` as in :meth:`validate`.
        Collective: call on every rank (see ``docs/export.md``)."""
        return export.export_program(self, path, example_inputs, format, checkpoint)

    def _standalone_evaluation(self, stage: Stage, checkpoint: Optional[str] = None) -> Dict[str, float]:
        self.load_checkpoint_weights(checkpoint, "validate" if stage is Stage.VAL else "test")
        self._prepare_callbacks()
        self.recorder.start_loggers()
        try:  # no scheduler steps, no progress counters: this is not training
            batch_size = self.args.val_batch_size or self.train_step_batch_size
            return self.evaluator.run(stage, self.progress.global_steps_finished, batch_size)
        finally:
            self.loggers.finish()

    def _evaluate(self, stage: Stage, max_batches: Optional[int] = None, record: bool = True) -> Dict[str, float]:
        batch_size = self.args.val_batch_size or self.train_step_batch_size
        results = self.evaluator.run(stage, self.progress.global_steps_finished, batch_size, max_batches, record)
        if record and stage is Stage.VAL:
            self.progress.last_validated_step = self.progress.global_steps_finished
            if self.automatic_optimization:
                self.lr_schedules.step_after_validation(self.progress.global_steps_finished, self.history)
        return results
