"""The whole-run ETA: the run's mean rate (wall time since the run began, validation included), not
the current epoch's, so it neither jumps between epochs nor leaves validation out."""

import time

from toy import ToyModule, toy_args

from framework import Trainer
from framework.callbacks.progress import ProgressBar, _Display, format_seconds


def test_run_eta_uses_the_runs_mean_rate_with_validation_time_included():
    now = time.monotonic()
    display = _Display(total=10, initial=0, check_seconds=1.0, run_left=50)
    display.started, display.done = now - 1.0, 10  # this epoch: 10 steps/s
    assert display.run_eta(now) == format_seconds(4.0)  # no run clock: the epoch's rate
    display.run_clock = (now - 20.0, 30)  # 30 steps in earlier epochs; 20 s of wall time, validation included
    assert display.run_eta(now) == format_seconds(20.0)  # (50 - 10) steps at 40 / 20 s


def test_the_progress_bar_keeps_one_run_clock_across_epochs_and_starts_afresh_per_train(tmp_path):
    bar = ProgressBar(style="lines")
    clocks = []

    class Spy(ToyModule):
        def on_end_train_epoch(self, global_step, *outputs):
            clocks.append(bar._train.run_clock)

    trainer = Trainer(Spy(), toy_args(tmp_path, epochs=3, disable_tqdm=False, train_batch_size=64), callbacks=[bar])
    trainer.train()
    assert len({began for began, _ in clocks}) == 1  # one origin for the whole run
    assert [before for _, before in clocks] == [0, 4, 8]  # the steps done before each epoch
    assert bar._run_clock is None
