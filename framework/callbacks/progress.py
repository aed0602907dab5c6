"""ProgressBar: a tqdm bar on rank zero that costs nothing per step beyond a counter."""

from typing import Any, Dict, Optional

from tqdm import tqdm

from framework.callbacks.base import Callback


class ProgressBar(Callback):
    """Shows optimizer steps per epoch, step/s, and the loss whenever it is logged.

    tqdm redraws at most every ``refresh_seconds``; the loss shown is the one read back at
    the last ``log_every_n_steps`` point, so the bar never forces a device sync.

    Example:
        trainer = Trainer(module, args, callbacks=[ProgressBar(refresh_seconds=1.0)])
    """

    def __init__(self, refresh_seconds: float = 0.5) -> None:
        self.refresh_seconds = refresh_seconds
        self._bar: Optional[tqdm] = None

    def _enabled(self) -> bool:
        return self.trainer.is_main_process and not self.trainer.args.disable_tqdm

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        if not self._enabled():
            return
        self._close()
        self._bar = tqdm(
            total=self.trainer.estimated_global_steps_per_epoch,
            initial=self.trainer.batches_finished_in_epoch // self.trainer.gradient_accumulation,  # mid-epoch resume
            desc=f"epoch {epoch + 1}/{self.trainer.args.epochs}",
            unit="step",
            mininterval=self.refresh_seconds,
            dynamic_ncols=True,
            leave=False,
        )

    def on_end_optimizer_step(self, global_step: int) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def on_log_metrics(self, global_step: int, metrics: Dict[str, float]) -> None:
        if self._bar is not None and "train_loss" in metrics:
            self._bar.set_postfix(loss=f"{metrics['train_loss']:.4f}", refresh=False)

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self._close()

    def on_end_train(self, global_step: int) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
