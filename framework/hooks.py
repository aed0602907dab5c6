"""The hooks of the training loop: one definition shared by ModuleInterface and Callback."""

from typing import Any, Dict

import torch


class TrainingHooks:
    """No-op hooks the trainer calls; override the ones you need.

    The trainer calls the module's hook first, then each callback's, in list order.
    ``global_step`` is always the number of optimizer steps finished so far.

    Example:
        >>> class PrintEpochs(TrainingHooks):
        ...     def on_begin_train_epoch(self, global_step, epoch):
        ...         print("epoch", epoch)
    """

    def on_begin_train(self, global_step: int) -> None:
        """Once, before the first epoch (after a resume: before the resumed one)."""

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        """Before each training epoch (``epoch`` counts from 0)."""

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        """After each micro-batch's backward (each chunk's under TBPTT); ``loss`` is unscaled."""

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        """After each micro-batch, with what ``train_step`` returned (loss first)."""

    def on_end_optimizer_step(self, global_step: int) -> None:
        """After each optimizer step (``global_step`` already counts it)."""

    def on_log_metrics(self, global_step: int, metrics: Dict[str, float]) -> None:
        """Whenever values are recorded (log points, epoch ends, evaluations), on every rank."""

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        """After each training epoch; ``outputs`` only with ``collect_train_outputs=True``."""

    def on_begin_val_epoch(self, global_step: int, key: str) -> None:
        """Before each validation loader (``key`` is its name, ``""`` for a single loader)."""

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each validation loader, with every ``val_step`` output gathered in dataset order."""

    def on_begin_test_epoch(self, global_step: int, key: str) -> None:
        """Before each test loader."""

    def on_end_test_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each test loader, with every ``test_step`` output gathered in dataset order."""

    def on_end_train(self, global_step: int) -> None:
        """Once, after the last epoch (also after a stop request)."""
