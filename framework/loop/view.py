"""What callbacks, the module and helpers may see of the trainer: a narrow, typed view.

:class:`TrainerView` names the members a callback (``self.trainer``) or the module
(``self.trainer``) may use, so neither imports :mod:`framework.loop.trainer`: the loop
imports them, never the other way round.
"""

from typing import Any, Dict, List, Optional, Protocol

import torch

from backends import TrainerBackend
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.config.arguments import TrainerArguments
from framework.metrics.collector import MetricHistory


class TrainerView(Protocol):
    """The trainer as callbacks and the module see it (:class:`~framework.Trainer` is one).

    Example:
        >>> from framework import Trainer
        >>> from framework.loop.view import TrainerView
        >>> def stop_when_low(trainer: TrainerView) -> None:
        ...     if trainer.history.latest("val_loss", default=1.0) < 0.1:
        ...         trainer.should_stop = True
    """

    args: TrainerArguments
    module: Any  # the ModuleInterface being trained (not imported: the module imports this view)
    backend: TrainerBackend
    checkpointer: AbstractCheckpointer
    history: MetricHistory
    callbacks: List[Any]
    should_stop: bool

    # Read-only: each belongs to one of the trainer's parts (``trainer.training_setup``, ...).
    @property
    def optimizers(self) -> List[torch.optim.Optimizer]: ...

    @property
    def schedulers(self) -> List[Any]: ...

    @property
    def lr_schedules(self) -> Any: ...  # LRSchedules: the schedulers with when each steps (.scheduled)

    @property
    def train_step_batch_size(self) -> int: ...

    @property
    def gradient_accumulation(self) -> int: ...

    @property
    def run_id(self) -> Optional[str]: ...

    @property
    def manual_optimization(self) -> Optional[Any]: ...  # with automatic_optimization = False, once set up

    @property
    def wrapped_module(self) -> Optional[torch.nn.Module]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def global_steps_finished(self) -> int: ...

    @property
    def epochs_finished(self) -> int: ...

    @property
    def batches_finished_in_epoch(self) -> int: ...

    @property
    def epoch_resumed(self) -> bool: ...

    @property
    def estimated_global_steps_per_epoch(self) -> Optional[int]: ...

    @property
    def checkpointing_enabled(self) -> bool: ...

    @property
    def sanity_checking(self) -> bool: ...  # True during the sanity validation before training: nothing is recorded

    def log_metrics(self, metrics: Dict[str, float]) -> None: ...

    def save_checkpoint(self, epoch: Optional[int] = None, force: bool = True) -> Optional[str]: ...

    def save_model_checkpoint(self) -> Optional[str]: ...

    def predict(self, checkpoint: Optional[str] = None, predictions_dir: Optional[str] = None) -> Any: ...
