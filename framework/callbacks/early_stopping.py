"""EarlyStopping: stop when a monitored metric stops improving."""

import logging
import math
from typing import Any, Dict, Optional

from framework.callbacks.base import Callback

logger = logging.getLogger(__name__)

_MODES = ("min", "max")


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    A check happens each time the trainer records ``monitor`` (for ``val_loss``: after every
    validation, including mid-epoch ones from ``val_every_n_steps``). A value improves when
    it beats the best so far by more than ``min_delta``. After ``patience`` checks without
    improvement (or a NaN/inf value, when ``check_finite``), the callback sets
    ``trainer.should_stop``; the trainer ends after the current step or epoch, but not
    before ``min_epochs`` epochs. Recorded metrics are already reduced over ranks, so every
    rank takes the same decision. ``best``, ``wait`` and where it stopped are saved in
    checkpoints.

    Args:
        monitor: name of a recorded metric, e.g. ``val_loss``, ``val_accuracy``,
            ``val_loss/<loader name>`` or ``train_loss_epoch``.
        mode: ``min`` (lower is better) or ``max``.
        patience: checks without improvement before stopping (>= 1).
        min_delta: smallest change that counts as an improvement (>= 0).
        check_finite: stop at once when the monitored value is NaN or infinite.
        strict: raise when other metrics of the same kind (``val_...``) are recorded but
            never ``monitor`` (a typo), and warn at the end if it was never recorded.

    Example:
        stopper = EarlyStopping(monitor="val_accuracy", mode="max", patience=3)
        trainer = Trainer(module, args, callbacks=[stopper])
        trainer.train()
        stopper.best, stopper.stopped_step
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        strict: bool = True,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping monitor={monitor!r} is invalid; allowed: a metric name such as 'val_loss'")
        if mode not in _MODES:
            raise ValueError(f"EarlyStopping mode={mode!r} is invalid; allowed: {_MODES}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping patience={patience!r} is invalid; allowed: an integer >= 1")
        if not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping min_delta={min_delta!r} is invalid; allowed: a number >= 0")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.strict = strict
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: Optional[int] = None
        self.wait = 0
        self.stopped_step: Optional[int] = None
        self.reason: Optional[str] = None
        self._seen = False

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_log_metrics(self, global_step: int, metrics: Dict[str, float]) -> None:
        value = metrics.get(self.monitor)
        if value is None:
            return
        self._seen = True
        if self.check_finite and not math.isfinite(value):
            self._stop(global_step, f"{self.monitor}={value} is not finite")
        elif self.improved(value):
            self.best, self.best_step, self.wait = float(value), global_step, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self._stop(
                    global_step,
                    f"{self.monitor} did not improve by more than {self.min_delta} for {self.wait} checks "
                    f"(best {self.best:.6g} at step {self.best_step})",
                )

    def _stop(self, global_step: int, reason: str) -> None:
        self.stopped_step, self.reason = global_step, reason
        self.trainer.should_stop = True
        logger.info("early stopping at step %d: %s", global_step, reason)

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        if not self.strict or self._seen or self.monitor in self.trainer.history.names():
            return
        kind = self.monitor.split("_", 1)[0] + "_"
        same_kind = [name for name in self.trainer.history.names() if name.startswith(kind)]
        if same_kind:
            raise ValueError(
                f"EarlyStopping monitors {self.monitor!r}, which is never recorded; "
                f"recorded metrics: {self.trainer.history.names()}"
            )

    def on_end_train(self, global_step: int) -> None:
        if self.strict and not self._seen and self.monitor not in self.trainer.history.names():
            logger.warning(
                "EarlyStopping monitored %r, which was never recorded (does the module return validation "
                "loaders?); recorded metrics: %s",
                self.monitor,
                self.trainer.history.names(),
            )

    def state_dict(self) -> Dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
            "stopped_step": self.stopped_step,
            "reason": self.reason,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        self.best = float(state["best"])
        self.best_step = state["best_step"]
        self.wait = int(state["wait"])
        self.stopped_step = state["stopped_step"]
        self.reason = state["reason"]
