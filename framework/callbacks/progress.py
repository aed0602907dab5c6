"""ProgressBar: training and evaluation progress on rank zero, for a terminal or a log file.

Per optimizer step it costs an integer increment and one comparison: the display (a tqdm bar,
or a plain log line) is touched only when the step count reaches the next check point, which
is set from the measured step rate so that checks happen about once per refresh interval.
"""

import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from framework.callbacks.base import Callback

if TYPE_CHECKING:
    from tqdm import tqdm

logger = logging.getLogger(__name__)

_STYLES = ("auto", "bar", "lines")
_LINE_FRACTIONS = 10  # plain lines: one at every 10% of the epoch


class _Display:
    """Counts steps towards ``total`` and draws when a check point is reached."""

    def __init__(self, total: Optional[int], initial: int, check_seconds: float, run_left: Optional[int] = None) -> None:
        self.total = total
        self.done = initial
        self.run_left = run_left  # optimizer steps left in the whole run when the display started
        self.next_check = initial + 1
        self._initial = initial
        self._check_seconds = check_seconds
        self.started = self.last_check = time.monotonic()
        self.run_clock: Optional[Tuple[float, int]] = None  # (when the run's first epoch began, its steps done before this epoch)

    def rate(self, now: float) -> Optional[float]:
        """Steps per second since the display started (None before the first)."""
        elapsed = now - self.started
        return (self.done - self._initial) / elapsed if elapsed > 0 and self.done > self._initial else None

    def check(self) -> None:
        """Draw what is due, then set the next check point (at least one step ahead)."""
        now = time.monotonic()
        self.draw(now)
        rate = self.rate(now)
        stride = max(1, int(rate * self._check_seconds)) if rate is not None else 1
        self.next_check = self.done + stride
        self.last_check = now

    def run_eta(self, now: float) -> Optional[str]:
        """The whole run's remaining time, as ``H:MM:SS`` (None: unknown), at the run's mean rate:
        steps since the run began over the wall time since (validation included), so it does not
        jump with one epoch's rate or leave validation out."""
        rate = self.rate(now)
        if self.run_clock is not None:
            began, steps_before = self.run_clock
            steps = steps_before + self.done - self._initial
            rate = steps / (now - began) if steps > 0 and now > began else rate
        if self.run_left is None or rate is None:
            return None
        seconds = max(0, self.run_left - (self.done - self._initial)) / rate
        return format_seconds(seconds)

    def draw(self, now: float) -> None:
        """Show ``done`` if due (subclasses)."""

    def set_values(self, values: Dict[str, float]) -> None:
        """Show ``values`` (the loss, ``prog_bar`` metrics) from the next draw on."""

    def close(self) -> None:
        """Show the final count and release the display."""


class _Bar(_Display):
    """A tqdm bar (``leave=False``): redrawn at most every ``refresh_seconds``."""

    def __init__(
        self, total: Optional[int], initial: int, refresh_seconds: float, desc: str, unit: str, run_left: Optional[int] = None
    ) -> None:
        super().__init__(total, initial, refresh_seconds / 2, run_left)  # checks twice per refresh: tqdm redraws on time
        self.values: Dict[str, float] = {}
        from tqdm import tqdm  # on first use: a run without a bar does not import it

        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            mininterval=refresh_seconds,
            dynamic_ncols=True,
            leave=False,
        )

    def draw(self, now: float) -> None:
        if self.done > self.bar.n:
            postfix = {name: f"{value:.4f}" for name, value in self.values.items()}
            eta = self.run_eta(now)
            if eta is not None:
                postfix["run ETA"] = eta
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(self.done - self.bar.n)

    def set_values(self, values: Dict[str, float]) -> None:
        self.values = dict(values)

    def close(self) -> None:
        self.draw(time.monotonic())
        self.bar.close()


class _Lines(_Display):
    """Plain log lines (for log files): at each 10% of the epoch (at most one per
    ``refresh_seconds``), at least every ``line_seconds``, and a last one when the epoch ends."""

    def __init__(
        self,
        total: Optional[int],
        initial: int,
        desc: str,
        refresh_seconds: float,
        line_seconds: float,
        run_left: Optional[int] = None,
    ) -> None:
        super().__init__(total, initial, min(refresh_seconds, line_seconds, 1.0), run_left)
        self.desc = desc
        self.values: Dict[str, float] = {}
        self._refresh_seconds = refresh_seconds
        self._line_seconds = line_seconds
        self._last_line = self.started
        self._last_line_step = initial
        self._next_mark = self._mark_after(initial)

    def _mark_after(self, steps: int) -> Optional[int]:
        """The first 10% mark of the epoch after ``steps`` (None: no length, or past the last)."""
        if not self.total:
            return None
        for part in range(1, _LINE_FRACTIONS + 1):
            mark = -(-self.total * part // _LINE_FRACTIONS)  # ceil
            if mark > steps:
                return mark
        return None

    def check(self) -> None:
        super().check()
        mark = self._next_mark
        if mark is not None and mark > self.done:
            self.next_check = min(self.next_check, mark)
        elif mark is not None:  # a mark passed less than refresh_seconds after the last line: look again then
            rate = self.rate(self.last_check) or 0.0
            wait = self._refresh_seconds - (self.last_check - self._last_line)
            self.next_check = min(self.next_check, self.done + max(1, int(rate * wait)))

    def draw(self, now: float) -> None:
        since = now - self._last_line
        at_mark = self._next_mark is not None and self.done >= self._next_mark and since >= self._refresh_seconds
        if at_mark or since >= self._line_seconds:
            self._write(now)

    def set_values(self, values: Dict[str, float]) -> None:
        self.values = dict(values)

    def _write(self, now: float) -> None:
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        rate = self.rate(now)
        parts = [f"{count} steps"]
        if rate is not None:
            parts.append(f"{rate:.1f} step/s")
        parts.extend(f"{name} {value:.4f}" for name, value in self.values.items())
        eta = self.run_eta(now)
        if eta is not None:
            parts.append(f"run ETA {eta}")
        logger.info("%s: %s", self.desc, ", ".join(parts))
        self._last_line, self._last_line_step = now, self.done
        self._next_mark = self._mark_after(self.done)

    def close(self) -> None:
        if self.done != self._last_line_step:  # an epoch shorter than the refresh still shows where it ended
            self._write(time.monotonic())


class ProgressBar(Callback):
    """Training progress (optimizer steps per epoch, step/s, the last logged loss, the values
    logged with ``prog_bar=True``, the whole run's ETA) and a bar per validation and test
    loader, on rank zero.

    In a terminal it draws tqdm bars that redraw at most every ``refresh_seconds``. When stderr
    is not a terminal (a Slurm or nohup log file), it writes plain log lines instead of ``\\r``
    frames: ``epoch 2/10: 120/230 steps, 45.1 step/s, loss 0.1234, run ETA 03:10`` at each 10% of the epoch
    (at most one per ``refresh_seconds``), at least every ``line_seconds``, and a last one when
    an epoch ends, so a short epoch still shows one line (through the ``framework`` logger at
    INFO: ``log_level="WARNING"`` hides them). Evaluation bars are shown in a terminal only.
    The loss shown is the one read back at the last ``log_every_n_steps`` point, so progress
    never forces a device sync.

    Args:
        refresh_seconds: at most one redraw of a bar (or one progress line) per this many
            seconds (0: every step).
        style: ``"auto"`` (bars in a terminal, lines otherwise), ``"bar"`` or ``"lines"``.
        line_seconds: with lines, the longest time between two lines.

    Example:
        trainer = Trainer(module, args, callbacks=[ProgressBar(refresh_seconds=1.0, style="lines")])
    """

    def __init__(self, refresh_seconds: float = 0.5, style: str = "auto", line_seconds: float = 60.0) -> None:
        if style not in _STYLES:
            raise ValueError(f"ProgressBar style={style!r} is invalid; allowed: {_STYLES}")
        for name, value in (("refresh_seconds", refresh_seconds), ("line_seconds", line_seconds)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"ProgressBar {name}={value!r} is invalid; allowed: seconds >= 0")
        self.refresh_seconds = float(refresh_seconds)
        self.style = style
        self.line_seconds = float(line_seconds)
        self._train: Optional[_Display] = None
        self._evaluation: Optional[_Display] = None
        self._values: Dict[str, float] = {}  # the loss and prog_bar metrics shown, kept across epochs
        self._run_clock: Optional[Tuple[float, int]] = None  # (time, global steps) when this run's first epoch began

    @property
    def _bar(self) -> Optional["tqdm"]:
        """The training epoch's tqdm bar, if one is shown."""
        return self._train.bar if isinstance(self._train, _Bar) else None

    def _enabled(self) -> bool:
        return self.trainer.is_main_process and not self.trainer.args.disable_tqdm

    def uses_lines(self) -> bool:
        """True when progress goes to plain log lines (``style="lines"``, or ``"auto"`` without a terminal)."""
        if self.style == "auto":
            isatty = getattr(sys.stderr, "isatty", None)
            return not (isatty is not None and isatty())
        return self.style == "lines"

    # -- training ---------------------------------------------------------------------------
    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self._close_train()
        if not self._enabled():
            return
        trainer = self.trainer
        total = trainer.estimated_global_steps_per_epoch
        initial = trainer.batches_finished_in_epoch // trainer.gradient_accumulation  # mid-epoch resume
        desc = f"epoch {epoch + 1}/{trainer.args.epochs}"
        run_left = self._run_steps_left(total, epoch, initial)
        if self.uses_lines():
            self._train = _Lines(total, initial, desc, self.refresh_seconds, self.line_seconds, run_left)
        else:
            self._train = _Bar(total, initial, self.refresh_seconds, desc, "step", run_left)
        if self._run_clock is None:
            self._run_clock = (time.monotonic(), trainer.global_steps_finished)
        self._train.run_clock = (self._run_clock[0], trainer.global_steps_finished - self._run_clock[1])
        self._train.set_values(self._values)

    def _run_steps_left(self, per_epoch: Optional[int], epoch: int, initial: int) -> Optional[int]:
        """Optimizer steps left in the run at this epoch's start (or resume point); None: unknown."""
        if not per_epoch:
            return None
        left = per_epoch * (self.trainer.args.epochs - epoch) - initial
        max_steps = self.trainer.args.max_steps
        if max_steps is not None:
            left = min(left, max_steps - self.trainer.global_steps_finished)
        return max(0, left)

    def on_end_optimizer_step(self, global_step: int) -> None:
        display = self._train
        if display is not None:
            display.done += 1
            if display.done >= display.next_check:
                display.check()

    def on_log_metrics(self, global_step: int, metrics: Dict[str, float]) -> None:
        if not self._enabled():
            return
        if "train_loss" in metrics:
            self._values["loss"] = metrics["train_loss"]
        chosen = self.trainer.module.progress_bar_names()
        for name, value in metrics.items():
            if _shown_name(name) in chosen:
                self._values[name] = value
        if self._train is not None:
            self._train.set_values(self._values)

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self._close_train()

    def on_end_train(self, global_step: int) -> None:
        self._close_train()
        self._run_clock = None  # the next train() measures its own rate

    def _close_train(self) -> None:
        if self._train is not None:
            self._train.close()
            self._train = None

    # -- evaluation -------------------------------------------------------------------------
    def _begin_evaluation(self, what: str, key: str) -> None:
        self._close_evaluation()
        if self._enabled() and not self.uses_lines():
            desc = f"{what} {key}" if key else what
            total = getattr(getattr(self.trainer, "evaluator", None), "current_batches", None)
            self._evaluation = _Bar(total, 0, self.refresh_seconds, desc, "batch")

    def _advance_evaluation(self) -> None:
        display = self._evaluation
        if display is not None:
            display.done += 1
            if display.done >= display.next_check:
                display.check()

    def _close_evaluation(self) -> None:
        if self._evaluation is not None:
            self._evaluation.close()
            self._evaluation = None

    def on_begin_val_epoch(self, global_step: int, key: str) -> None:
        self._begin_evaluation("sanity checking" if self.trainer.sanity_checking else "validating", key)

    def on_end_val_step(self, global_step: int, *outputs: Any, key: str) -> None:
        self._advance_evaluation()

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        self._close_evaluation()

    def on_begin_test_epoch(self, global_step: int, key: str) -> None:
        self._begin_evaluation("testing", key)

    def on_end_test_step(self, global_step: int, *outputs: Any, key: str) -> None:
        self._advance_evaluation()

    def on_end_test_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        self._close_evaluation()


def _shown_name(name: str) -> str:
    """The name given to ``self.log`` behind a recorded one (``val_acc/loader``, ``acc_epoch`` -> ``val_acc``, ``acc``)."""
    name = name.split("/", 1)[0]
    return name[: -len("_epoch")] if name.endswith("_epoch") else name


def format_seconds(seconds: float) -> str:
    """``H:MM:SS`` (``MM:SS`` under an hour).

    Example:
        >>> format_seconds(75.4), format_seconds(3725)
        ('01:15', '1:02:05')
    """
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
