"""Built-in callbacks: EarlyStopping, TerminateOnNaN, LearningRateMonitor, ModelSummary, Timer,
ProgressBar; hook order, StopTraining, callback state in checkpoints; 2-rank agreement."""

import functools
import logging
import math
import os
import sys
from types import SimpleNamespace
from typing import List

import pytest
import torch
from logs import captured_log

from distributed import run_ranks
from toy import ToyModule, flat_parameters, toy_args

from backends import MixedPrecision, TrainerBackend
from framework import Trainer, TrainerArguments, TrainingDiverged
from framework.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelSummary,
    ProgressBar,
    StopTraining,
    TerminateOnNaN,
    Timer,
)
from framework.callbacks.lr_monitor import learning_rates
from framework.callbacks.model_summary import summary_rows
from framework.checkpoint import DefaultCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.metrics.collector import MetricHistory

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


make_args = functools.partial(toy_args, epochs=2, train_batch_size=32)


class NaNAtStep(ToyModule):
    """Returns a NaN loss at ``nan_step`` (on ``nan_rank`` only, when given)."""

    def __init__(self, nan_step: int, nan_rank=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_step, self.nan_rank = nan_step, nan_rank

    def train_step(self, global_step, batch, device):
        loss = super().train_step(global_step, batch, device)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if global_step == self.nan_step and self.nan_rank in (None, rank):
            loss = loss * float("nan")
        return loss


# -- EarlyStopping ------------------------------------------------------------------------


def fake_trainer() -> SimpleNamespace:
    return SimpleNamespace(should_stop=False, history=MetricHistory())


def test_early_stopping_counts_checks_without_improvement_beyond_min_delta():
    stopper = EarlyStopping(monitor="val_accuracy", mode="max", patience=2, min_delta=0.01)
    stopper.setup(fake_trainer())
    stopper.on_log_metrics(10, {"val_accuracy": 0.50})
    stopper.on_log_metrics(15, {"train_loss": 0.3})  # not the monitored metric: no check
    stopper.on_log_metrics(20, {"val_accuracy": 0.505})  # better, but not by more than min_delta
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.trainer.should_stop) == (0.50, 10, 1, False)
    stopper.on_log_metrics(30, {"val_accuracy": 0.60})  # a real improvement resets the count
    assert (stopper.best, stopper.wait) == (0.60, 0)
    stopper.on_log_metrics(40, {"val_accuracy": 0.59})
    stopper.on_log_metrics(50, {"val_accuracy": 0.60})
    assert stopper.trainer.should_stop and stopper.stopped_step == 50
    assert stopper.reason == "val_accuracy did not improve by more than 0.01 for 2 checks (best 0.6 at step 30)"


def test_early_stopping_stops_at_once_on_a_nan_metric():
    stopper = EarlyStopping(patience=10)
    stopper.setup(fake_trainer())
    stopper.on_log_metrics(5, {"val_loss": 1.0})
    stopper.on_log_metrics(6, {"val_loss": float("nan")})
    assert stopper.trainer.should_stop and "val_loss=nan is not finite" in stopper.reason


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "best"}, "mode='best' is invalid; allowed: ('min', 'max')"),
        ({"patience": 0}, "patience=0 is invalid; allowed: an integer >= 1"),
        ({"min_delta": -0.1}, "min_delta=-0.1 is invalid; allowed: a number >= 0"),
        ({"monitor": ""}, "monitor='' is invalid"),
    ],
)
def test_early_stopping_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as error:
        EarlyStopping(**kwargs)
    assert message in str(error.value)


def test_early_stopping_ends_training_after_patience_epochs_but_not_before_min_epochs(tmp_path):
    # lr=0: the validation loss never improves after the first check.
    stopper = EarlyStopping(patience=2)
    trainer = Trainer(ToyModule(lr=0.0, scheduler=None), make_args(tmp_path, epochs=10), callbacks=[stopper])
    history = trainer.train()
    assert trainer.epochs_finished == 3 and len(history.values("val_loss")) == 3
    assert stopper.stopped_step == trainer.global_steps_finished == 24
    assert stopper.best == history.values("val_loss")[0] and stopper.best_step == 8

    stopper = EarlyStopping(patience=2)
    trainer = Trainer(
        ToyModule(lr=0.0, scheduler=None), make_args(tmp_path / "min_epochs", epochs=10, min_epochs=5), callbacks=[stopper]
    )
    trainer.train()
    assert trainer.epochs_finished == 5  # asked to stop after 3, honoured once min_epochs were done


def test_early_stopping_on_mid_epoch_validation_stops_mid_epoch(tmp_path):
    stopper = EarlyStopping(patience=1)
    args = make_args(tmp_path, epochs=3, val_every_n_steps=2, val_every_n_epochs=0)
    trainer = Trainer(ToyModule(lr=0.0, scheduler=None), args, callbacks=[stopper])
    history = trainer.train()
    # 8 steps per epoch; validations at steps 2 (best) and 4 (no improvement: stop).
    assert [step for step, _ in history.steps("val_loss")] == [2, 4]
    assert trainer.global_steps_finished == 4 and stopper.stopped_step == 4


def test_early_stopping_with_a_misspelt_monitor_fails_fast(tmp_path):
    trainer = Trainer(ToyModule(), make_args(tmp_path, epochs=3), callbacks=[EarlyStopping(monitor="val_los")])
    with pytest.raises(ValueError) as error:
        trainer.train()
    assert "EarlyStopping monitors 'val_los', which is never recorded" in str(error.value)
    assert "'val_loss'" in str(error.value)  # the recorded names are listed
    assert trainer.epochs_finished == 1


class CountSteps(Callback):
    """A user's callback with state, in torch's protocol (``state_dict``/``load_state_dict``)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_end_optimizer_step(self, global_step):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_callback_states_survive_checkpoint_resume(tmp_path):
    checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=1)
    first_stopper, first_timer, first_counter = EarlyStopping(patience=5), Timer(), CountSteps()
    first = Trainer(
        ToyModule(lr=0.0, scheduler=None),
        make_args(tmp_path, checkpoints),
        callbacks=[first_stopper, first_timer, first_counter],
    )
    first.train()
    assert first_stopper.wait == 1 and len(first_timer.epoch_seconds) == 2
    assert first_counter.steps == first.global_steps_finished > 0

    resume = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt2"), load_dir=str(tmp_path / "ckpt"), period=0)
    stopper, timer, counter = EarlyStopping(patience=5), Timer(), CountSteps()
    second = Trainer(
        ToyModule(lr=0.0, scheduler=None),
        make_args(tmp_path / "resumed", resume, epochs=4),
        callbacks=[stopper, timer, counter],
    )
    history = second.train()
    assert counter.steps == second.global_steps_finished == 2 * first.global_steps_finished  # restored, then counted on
    assert second.epochs_finished == 4 and len(history.values("val_loss")) == 4
    assert stopper.best == first_stopper.best and stopper.best_step == 8
    assert stopper.wait == 3  # 1 restored + 2 new checks
    assert len(timer.epoch_seconds) == 4 and timer.epoch_seconds[:2] == first_timer.epoch_seconds
    times = history.values("train_time")
    assert times == sorted(times) and timer.total_seconds > first_timer.total_seconds


def test_a_plugin_with_the_old_state_method_names_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"OldCounter defines get_state.*rename get_state -> state_dict"):

        class OldCounter(Callback):
            def get_state(self):
                return {"steps": 1}

    with pytest.raises(TypeError, match=r"OldRestore defines update_state.*update_state -> load_state_dict"):

        class OldRestore(Callback):
            def update_state(self, state):
                pass

    with pytest.raises(TypeError, match=r"OldCheckpointer defines get_state and update_state.*docs/checkpointing.md"):

        class OldCheckpointer(DefaultCheckpointer):
            def get_state(self):
                return {}

            def update_state(self, state):
                pass

    with pytest.raises(TypeError, match=r"OldScaling defines get_state.*docs/backends.md"):

        class OldScaling(MixedPrecision):
            def get_state(self):
                return {}

    with pytest.raises(TypeError, match=r"OldBackend defines update_state.*docs/backends.md"):

        class OldBackend(TrainerBackend):
            def update_state(self, state):
                pass


# -- TerminateOnNaN -----------------------------------------------------------------------


def test_terminate_on_nan_stops_before_the_update_and_keeps_only_good_checkpoints(tmp_path):
    checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=0, save_every_n_steps=2)
    guard = TerminateOnNaN()
    trainer = Trainer(NaNAtStep(nan_step=5), make_args(tmp_path, checkpoints, epochs=3), callbacks=[guard])
    with captured_log("framework.callbacks.terminate_on_nan") as messages:
        trainer.train()
    assert guard.stopped_step == 5 and trainer.global_steps_finished == 5
    assert len(messages) == 1 and "loss=nan at global_step=5 (epoch 0)" in messages[0]
    assert torch.isfinite(flat_parameters(trainer.module)).all()
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    assert saved == ["checkpoint-000000002.pt", "checkpoint-000000004.pt"]  # no final save of the stopped run
    latest = DefaultCheckpointer(DefaultCheckpointerArguments(load_dir=str(tmp_path / "ckpt"))).load()
    assert latest.global_step == 4
    assert all(torch.isfinite(value).all() for value in latest.module_state["model"].values())

    # Without the callback the NaN reaches the weights; by default the trainer stops at the next read.
    unguarded = Trainer(NaNAtStep(nan_step=5), make_args(tmp_path / "unguarded", epochs=1, stop_on_nonfinite_loss=False))
    unguarded.train()
    assert not torch.isfinite(flat_parameters(unguarded.module)).all()
    with pytest.raises(TrainingDiverged, match="global_step=5 "):
        Trainer(NaNAtStep(nan_step=5), make_args(tmp_path / "default", epochs=1)).train()


# -- StopTraining, hook order ------------------------------------------------------------


class StopAt(Callback):
    def __init__(self, step: int, save_checkpoint: bool = True) -> None:
        self.step, self.save_checkpoint = step, save_checkpoint

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step == self.step:
            raise StopTraining(f"reached {global_step}", save_checkpoint=self.save_checkpoint)


def test_stop_training_saves_the_final_checkpoint_unless_told_not_to(tmp_path):
    for save, expected in [(True, ["checkpoint-000000003.pt"]), (False, [])]:
        directory = tmp_path / f"ckpt-{save}"
        checkpoints = DefaultCheckpointerArguments(save_dir=str(directory), period=0)
        trainer = Trainer(ToyModule(), make_args(tmp_path / f"out-{save}", checkpoints), callbacks=[StopAt(3, save)])
        trainer.train()
        assert trainer.global_steps_finished == 3
        assert (sorted(os.listdir(directory)) if directory.exists() else []) == expected
    assert StopTraining("x").save_checkpoint is True


class Recorder(Callback):
    def __init__(self, name: str, calls: List[str]) -> None:
        self.name, self.calls = name, calls

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.calls.append(self.name)


class RecordingModule(ToyModule):
    def on_begin_train_epoch(self, global_step, epoch):
        self.hook_calls.append("module")


def test_hooks_run_module_first_then_callbacks_in_list_order(tmp_path):
    calls: List[str] = []
    module = RecordingModule(val_loaders=0)
    module.hook_calls = calls
    trainer = Trainer(module, make_args(tmp_path, epochs=2), callbacks=[Recorder("b", calls), Recorder("a", calls)])
    trainer.train()
    assert calls == ["module", "b", "a"] * 2


# -- LearningRateMonitor ------------------------------------------------------------------


def test_learning_rate_monitor_records_the_rate_each_logged_step_used(tmp_path):
    # StepLR(step_size=3, gamma=0.5) from lr=0.05: steps 1-3 use 0.05, 4-6 use 0.025, ...
    args = make_args(tmp_path, epochs=1, log_every_n_steps=2)
    trainer = Trainer(ToyModule(scheduler="step"), args, callbacks=[LearningRateMonitor()])
    history = trainer.train()
    steps = [step for step, _ in history.steps("lr")]
    assert steps == [2, 4, 6, 8]
    assert history.values("lr") == pytest.approx([0.05 * 0.5 ** ((step - 1) // 3) for step in steps])

    trainer = Trainer(
        ToyModule(scheduler="step"), make_args(tmp_path / "per_epoch", epochs=2), callbacks=[LearningRateMonitor("epoch")]
    )
    history = trainer.train()
    assert [step for step, _ in history.steps("lr")] == [0, 8]
    assert history.values("lr") == pytest.approx([0.05, 0.05 * 0.5**2])


def test_learning_rate_monitor_takes_lightnings_logging_interval(tmp_path):
    # Lightning's keyword (mutant: logging_interval ignored -> "step" points, [2, 4, 6, 8]) and its
    # default None: the schedulers' interval (mutant: None read as "step" -> 16 step points).

    class EpochScheduler(ToyModule):
        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            step = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            return [optimizer], [{"scheduler": step, "interval": "epoch"}]

    def lr_steps(name, module, monitor):
        trainer = Trainer(module, make_args(tmp_path / name, epochs=2, log_every_n_steps=2), callbacks=[monitor])
        return [step for step, _ in trainer.train().steps("lr")]

    assert lr_steps("keyword", ToyModule(scheduler="step"), LearningRateMonitor(logging_interval="epoch")) == [0, 8]
    assert lr_steps("default_epochly", EpochScheduler(), LearningRateMonitor()) == [0, 8]
    assert lr_steps("default_steply", ToyModule(scheduler="step"), LearningRateMonitor(logging_interval=None)) == list(
        range(2, 17, 2)
    )
    with pytest.raises(ValueError, match="logging_interval='batch' is invalid"):
        LearningRateMonitor(logging_interval="batch")
    with pytest.raises(ValueError, match="interval='epoch' and logging_interval='step' disagree"):
        LearningRateMonitor(interval="epoch", logging_interval="step")


def test_learning_rates_names_optimizers_and_groups():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first = torch.optim.SGD([{"params": a.weight, "lr": 0.1}, {"params": a.bias, "lr": 0.2}])
    second = torch.optim.Adam(b.parameters(), lr=0.3)
    assert learning_rates([first, second]) == {"lr/opt0/group0": 0.1, "lr/opt0/group1": 0.2, "lr/opt1": 0.3}
    with pytest.raises(ValueError, match="interval='batch' is invalid; allowed: \\('step', 'epoch'\\) or None"):
        LearningRateMonitor(interval="batch")


# -- ModelSummary, Timer, ProgressBar -----------------------------------------------------


class TwoParts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)
        self.tied = torch.nn.Linear(3, 2)
        self.tied.weight = self.head.weight  # shared: counted once, with the first child
        self.scale = torch.nn.Parameter(torch.ones(5))
        for parameter in self.encoder.parameters():
            parameter.requires_grad = False


def test_summary_rows_count_each_child_once_and_split_trainable():
    rows = summary_rows(TwoParts())
    assert [(r.name, r.type_name, r.parameters, r.trainable) for r in rows] == [
        ("encoder", "Linear", 15, 0),
        ("head", "Linear", 8, 8),
        ("tied", "Linear", 2, 2),
        ("(own)", "TwoParts", 5, 5),
    ]


def test_model_summary_logs_parameter_counts_when_training_starts(tmp_path):
    summary = ModelSummary()
    module = ToyModule(val_loaders=0)
    total = sum(p.numel() for p in module.parameters())
    trainer = Trainer(module, make_args(tmp_path, epochs=1, log_level="INFO"), callbacks=[summary])
    with captured_log("framework.callbacks.model_summary") as messages:
        trainer.train()
    assert len(messages) == 1 and summary.summary in messages[0]
    assert f"net   Sequential  {total:>12,}  {total:>12,}" in summary.summary
    assert f"trainable: {total:,}  frozen: 0  total: {total:,}" in summary.summary


def test_timer_records_epoch_and_total_time(tmp_path):
    timer = Timer()
    trainer = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, epochs=2), callbacks=[timer])
    history = trainer.train()
    epochs, totals = history.values("train_epoch_time"), history.values("train_time")
    assert epochs == timer.epoch_seconds and len(epochs) == 2 and all(t > 0 for t in epochs)
    assert len(totals) == 3 and totals == sorted(totals) and totals[-1] >= sum(epochs)
    assert totals[-1] == pytest.approx(timer.total_seconds)


def test_progress_bar_shows_steps_rate_and_logged_loss(tmp_path, capsys):
    args = make_args(tmp_path, epochs=1, disable_tqdm=False, log_every_n_steps=2)
    trainer = Trainer(ToyModule(val_loaders=0), args, callbacks=[ProgressBar(refresh_seconds=0, style="bar")])
    assert sum(isinstance(c, ProgressBar) for c in trainer.callbacks) == 1  # no second, default bar
    history = trainer.train()
    err = capsys.readouterr().err
    assert "epoch 1/1" in err and "8/8" in err and "step/s" in err
    # The loss logged at step 6 is shown from step 7 on (the postfix waits for the next redraw).
    assert "7/8 [" in err and f"loss={history.values('train_loss')[-2]:.4f}, run ETA=00:0" in err


def test_progress_bar_resumed_mid_epoch_starts_at_the_resumed_step(tmp_path, capsys):
    checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=0, save_every_n_steps=3, save_at_end=False)
    Trainer(ToyModule(val_loaders=0), make_args(tmp_path, checkpoints, epochs=1, max_steps=3)).train()
    resume = DefaultCheckpointerArguments(load_dir=str(tmp_path / "ckpt"), period=0, save_at_end=False)
    args = make_args(tmp_path / "resumed", resume, epochs=1, disable_tqdm=False)
    capsys.readouterr()
    trainer = Trainer(ToyModule(val_loaders=0), args, callbacks=[ProgressBar(refresh_seconds=0, style="bar")])
    trainer.train()
    frames = [frame for frame in capsys.readouterr().err.split("\r") if frame.startswith("epoch 1/1")]
    assert trainer.global_steps_finished == 8
    assert " 3/8 [" in frames[0] and " 8/8 [" in frames[-1]


# -- the example, and 2 ranks ---------------------------------------------------------------


def test_callbacks_example_stops_early_and_writes_its_outputs(tmp_path):
    sys.path.insert(0, EXAMPLES)
    try:
        import callbacks_example
    finally:
        sys.path.remove(EXAMPLES)
    out = tmp_path / "example"
    trainer = callbacks_example.main(
        ["--trainer.disable_tqdm", "--trainer.log_level=WARNING", f"--trainer.output_dir={out}", "--early_stopping.patience=1"]
    )
    stopper = trainer.callbacks[-1]
    assert isinstance(stopper, EarlyStopping) and stopper.stopped_step == trainer.global_steps_finished
    assert trainer.epochs_finished < 20 and trainer.history.values("lr")
    val_steps = [step for step, _ in trainer.history.steps("val_loss")]
    assert val_steps == list(range(10, trainer.global_steps_finished + 1, 10))  # mid-epoch, every 10 steps
    assert sorted(os.listdir(out)) == ["config.yaml", "metrics.csv", "metrics.png", "run_id"]


class BarProbe(ProgressBar):
    def on_end_optimizer_step(self, global_step: int) -> None:
        self.had_bar = self._bar is not None
        super().on_end_optimizer_step(global_step)


def _two_rank_callbacks(rank: int, out: str):
    # 1) Early stopping on the (gathered, identical) validation loss.
    stopper, bar = EarlyStopping(patience=1, min_delta=0.05), BarProbe(refresh_seconds=60, style="bar")
    args = TrainerArguments(
        epochs=8,
        train_batch_size=32,
        backend="ddp",
        seed=0,
        log_level="ERROR",
        output_dir=out,
        disable_tqdm=False,
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    trainer = Trainer(ToyModule(lr=0.02), args, callbacks=[bar, stopper])
    trainer.train()
    stopped = (trainer.epochs_finished, trainer.global_steps_finished, stopper.stopped_step, stopper.best, stopper.wait)
    # 2) A NaN loss on rank 1 only: both ranks stop at the same step.
    guard = TerminateOnNaN()
    args = TrainerArguments(**{**vars(args), "epochs": 2, "disable_tqdm": True, "output_dir": os.path.join(out, "nan")})
    nan_trainer = Trainer(NaNAtStep(nan_step=3, nan_rank=1), args, callbacks=[guard])
    with captured_log("framework.callbacks.terminate_on_nan") as messages:
        logging.getLogger("framework").setLevel(logging.WARNING)
        nan_trainer.train()
    finite = bool(torch.isfinite(flat_parameters(nan_trainer.module)).all())
    nan_trainer.close()
    return stopped, bar.had_bar, guard.stopped_step, nan_trainer.global_steps_finished, finite, messages


@pytest.mark.distributed
def test_two_ranks_agree_on_early_stopping_and_nan_termination(tmp_path):
    rank0, rank1 = run_ranks(_two_rank_callbacks, out=str(tmp_path))
    assert rank0[0] == rank1[0]  # same epoch, step, best and wait on both ranks
    epochs, steps, stopped_step, _, _ = rank0[0]
    assert epochs < 8 and stopped_step == steps  # it did stop early
    assert (rank0[1], rank1[1]) == (True, False)  # the progress bar lives on rank 0 only
    assert rank0[2:5] == rank1[2:5] == (3, 3, True)
    assert "a non-finite loss on another rank at global_step=3" in rank0[5][0]
    assert "loss=nan at global_step=3" in rank1[5][0]
    assert not math.isnan(rank0[0][3])
