"""Timer: wall-clock time per training epoch and for the whole run, as metrics."""

import time
from typing import Any, Dict, List, Optional

from framework.callbacks.base import Callback


class Timer(Callback):
    """Record ``train_epoch_time`` (seconds of each epoch's training loop, validation not
    included) and ``train_time`` (total training wall time so far, validation included).

    Both are recorded at the end of every train epoch, ``train_time`` also when training
    ends. The total survives checkpoint resume: the time of the run before the resume is
    saved in the callback's state and added. Times are host clocks: no device sync.

    Args:
        prefix: prepended to the metric names (e.g. ``"time/"``).

    Example:
        timer = Timer()
        trainer = Trainer(module, args, callbacks=[timer])
        trainer.train()
        timer.total_seconds, timer.epoch_seconds
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.epoch_seconds: List[float] = []
        self._previous_runs = 0.0
        self._run_start: Optional[float] = None
        self._epoch_start: Optional[float] = None

    @property
    def total_seconds(self) -> float:
        """Training wall time so far, runs before a resume included."""
        running = time.monotonic() - self._run_start if self._run_start is not None else 0.0
        return self._previous_runs + running

    def on_begin_train(self, global_step: int) -> None:
        self._run_start = time.monotonic()

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self._epoch_start = time.monotonic()

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        if self._epoch_start is None:
            return
        seconds = time.monotonic() - self._epoch_start
        self.epoch_seconds.append(seconds)
        self._epoch_start = None
        self.trainer.log_metrics({f"{self.prefix}train_epoch_time": seconds, f"{self.prefix}train_time": self.total_seconds})

    def on_end_train(self, global_step: int) -> None:
        if self._run_start is None:
            return
        self._previous_runs, self._run_start = self.total_seconds, None
        self.trainer.log_metrics({f"{self.prefix}train_time": self._previous_runs})

    def state_dict(self) -> Dict[str, Any]:
        return {"total_seconds": self.total_seconds, "epoch_seconds": list(self.epoch_seconds)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        # The trainer restores state before on_begin_train starts this run's clock.
        self._previous_runs = float(state["total_seconds"])
        self.epoch_seconds = [float(s) for s in state["epoch_seconds"]]
