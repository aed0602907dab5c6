"""self.log: values stay on the device, step values at log points, epoch reductions over
steps and over 2 gloo ranks; CSV and TensorBoard writers; writers after train()."""

import csv
import functools
import os

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from toy import ToyModule, toy_args

import framework.metrics.recorder as recorder_module
from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.metrics.collector import MetricCollector, MetricNotLoggedOnEveryRank, reduce_metrics

make_args = functools.partial(toy_args, train_batch_size=32)


def assert_series(actual, expected):
    """``[(step, value), ...]`` equal in steps, close in values (float32 on the device)."""
    assert [step for step, _ in actual] == [step for step, _ in expected]
    assert [value for _, value in actual] == pytest.approx([value for _, value in expected], rel=1e-6)


# -- MetricCollector ---------------------------------------------------------------------


def test_collector_keeps_values_on_their_device_and_never_reads_them_back():
    # Meta tensors have no data: any host read-back (.item(), float()) would raise.
    collector = MetricCollector()
    for _ in range(3):
        collector.log("acc", torch.ones(8, device="meta"), on_step=True)
        collector.log("seen", torch.tensor(8.0, device="meta"), reduce="sum")
        collector.log("peak", torch.ones((), device="meta"), reduce="max")
    step, epoch = collector.pop_step(), collector.pop_epoch()
    assert list(step) == ["acc"] and list(epoch) == ["acc_epoch", "peak", "seen"]
    assert all(value.device.type == "meta" and value.shape == () for value, *_ in [*step.values(), *epoch.values()])
    assert collector.pop_step() == {} and collector.pop_epoch() == {}


def test_collector_reduces_over_the_epoch_and_keeps_the_latest_step_value():
    collector = MetricCollector()
    for value in (1.0, 4.0, 2.0):
        collector.log("mean", torch.tensor(value), on_step=True)
        collector.log("sum", value, reduce="sum")
        collector.log("max", torch.tensor([value, 0.0]), reduce="max")  # per-sample values: max first
        collector.log("min", torch.tensor(value), reduce="min")
    as_floats = lambda collected: {name: float(value) for name, (value, *_) in collected.items()}  # noqa: E731
    assert as_floats(collector.pop_step()) == {"mean": 2.0}
    assert as_floats(collector.pop_epoch()) == pytest.approx({"max": 4.0, "mean_epoch": 7.0 / 3, "min": 1.0, "sum": 7.0})


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda c: c.log("x", 1.0, reduce="median"),
            "log('x', reduce='median'): allowed reductions are ('mean', 'sum', 'max', 'min')",
        ),
        (
            lambda c: c.log("x", 1.0, on_step=False, on_epoch=False),
            "log('x', on_step=False, on_epoch=False) would record nothing",
        ),
        (
            lambda c: (c.log("x", 1.0), c.log("x", 1.0, reduce="sum")),
            "log('x', reduce='sum'): this metric was logged with reduce='mean'",
        ),
        (lambda c: c.log("x", "high"), "expected a tensor, a number or a torchmetrics Metric, got str"),
        (lambda c: c.log("", 1.0), "the name must be a non-empty string"),
    ],
)
def test_collector_rejects_bad_calls_with_the_reason(call, message):
    with pytest.raises((ValueError, TypeError)) as error:
        call(MetricCollector())
    assert message in str(error.value)


def test_reduce_metrics_uses_one_collective_per_reduction_kind():
    calls = []

    def fake_all_reduce(tensor, op):
        calls.append((op, tuple(tensor.shape)))
        return tensor * 2

    collected = {"a": (torch.tensor(1.0), "mean"), "b": (torch.tensor(2.0), "sum"), "c": (torch.tensor(3.0), "mean")}
    # A mean travels as (value x weight, weight) summed over ranks: its ratio is unchanged here.
    assert reduce_metrics(collected, fake_all_reduce) == {"a": 1.0, "b": 4.0, "c": 3.0}
    assert sorted(calls) == [("sum", (1,)), ("sum", (2, 2))]


# -- self.log inside a run ----------------------------------------------------------------


class LoggingModule(ToyModule):
    """Logs per-step accuracy (step and epoch), a sample count (sum) and the largest loss (max)."""

    def train_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(1) == y).float(), on_step=True)
        self.log("samples", torch.tensor(float(len(y)), device=device), reduce="sum")
        self.log("max_loss", loss, reduce="max")
        self.logged.append((global_step + 1, (logits.argmax(1) == y).float().mean().item(), loss.item()))
        return loss

    def val_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.log("val_samples", float(len(y)), reduce="sum")
        return F.cross_entropy(logits, y, reduction="none"), (logits.argmax(1) == y).float()

    def get_test_dataloaders(self, sampler, batch_size):
        return torch.utils.data.DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def on_end_train_epoch(self, global_step, *outputs):
        self.log("epoch_hook", 7.0)  # logged from a hook: recorded with this epoch's values


def test_logged_values_reach_history_at_log_points_and_epoch_end(tmp_path, monkeypatch):
    reduce_steps = []
    original = recorder_module.reduce_metrics

    def counting_reduce(collected, *args):
        reduce_steps.append((trainer.global_steps_finished, tuple(collected)))
        return original(collected, *args)

    monkeypatch.setattr(recorder_module, "reduce_metrics", counting_reduce)
    module = LoggingModule(val_loaders=2)
    module.logged = []
    trainer = Trainer(module, make_args(tmp_path, epochs=2, log_every_n_steps=3))
    history = trainer.train()

    # on_step: the value of the step at each log point (every 3 optimizer steps).
    by_step = {step: (acc, loss) for step, acc, loss in module.logged}
    assert_series(history.steps("train_acc"), [(s, by_step[s][0]) for s in (3, 6, 9, 12, 15)])
    # on_epoch: mean / sum / max over each epoch's steps, recorded at the epoch's last step.
    epochs = [module.logged[:8], module.logged[8:]]
    assert_series(
        history.steps("train_acc_epoch"), [(8, sum(a for _, a, _ in epochs[0]) / 8), (16, sum(a for _, a, _ in epochs[1]) / 8)]
    )
    assert history.steps("samples") == [(8, 256.0), (16, 256.0)]
    assert_series(
        history.steps("max_loss"), [(8, max(loss for _, _, loss in epochs[0])), (16, max(loss for _, _, loss in epochs[1]))]
    )
    assert history.steps("epoch_hook") == [(8, 7.0), (16, 7.0)]
    # evaluation values: per loader, with the loader's name.
    assert history.steps("val_samples/set0") == history.steps("val_samples/set1") == [(8, 64.0), (16, 64.0)]
    # Read back only at log points, epoch ends and evaluations: never on the other steps.
    assert sorted({step for step, _ in reduce_steps}) == [3, 6, 8, 9, 12, 15, 16]


def test_csv_holds_every_record_and_a_later_test_run_is_appended(tmp_path):
    trainer = Trainer(LoggingModule(), make_args(tmp_path, epochs=2, log_every_n_steps=4))
    trainer.module.logged = []
    history = trainer.train()
    results = trainer.test()
    assert set(results) == {"test_loss", "val_samples"}  # test_step defaults to val_step
    with open(tmp_path / "run" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(r["epoch"]), int(r["step"]), r["name"], float(r["value"])) for r in rows] == [
        (r["epoch"], r["step"], r["name"], r["value"]) for r in history.records
    ]
    assert rows[-2]["name"] == "test_loss" and float(rows[-2]["value"]) == results["test_loss"]


def test_tensorboard_writer_writes_every_scalar_once_even_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=1)
    first = Trainer(
        ToyModule(), make_args(tmp_path, epochs=2, log_every_n_steps=4, tensorboard=True, checkpointer_args=checkpoints)
    )
    first.train()
    # Resume from the epoch-1 checkpoint (step 8): steps 9..16 run again, and are logged again.
    resume = DefaultCheckpointerArguments(
        save_dir=str(tmp_path / "ckpt"),
        load_filename=str(tmp_path / "ckpt" / "checkpoint-000000008.pt"),
        period=0,
        save_at_end=False,
    )
    second = Trainer(ToyModule(), make_args(tmp_path, epochs=2, log_every_n_steps=4, tensorboard=True, checkpointer_args=resume))
    history = second.train()
    assert [step for step, _ in history.steps("train_loss")] == [4, 8, 12, 16]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(history.names())
    for name in history.names():
        assert_series([(e.step, e.value) for e in events.Scalars(name)], history.steps(name))


# -- 2 ranks ------------------------------------------------------------------------------


class RankValues(ToyModule):
    """Logs rank-dependent values: rank 0 logs 1, rank 1 logs 2 (on every step and in val)."""

    def train_step(self, global_step, batch, device):
        value = torch.tensor(float(torch.distributed.get_rank() + 1), device=device)
        for reduce in ("mean", "sum", "max", "min"):
            self.log(f"r_{reduce}", value * (global_step + 1), on_step=True, reduce=reduce)
        return super().train_step(global_step, batch, device)

    def val_step(self, global_step, batch, device):
        self.log("val_rank_sum", float(torch.distributed.get_rank() + 1), reduce="sum")
        return super().val_step(global_step, batch, device)


def _two_rank_metrics(rank: int, out: str):
    args = TrainerArguments(
        epochs=1,
        train_batch_size=32,
        backend="ddp",
        seed=0,
        disable_tqdm=True,
        log_level="ERROR",
        output_dir=out,
        log_every_n_steps=2,
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    trainer = Trainer(RankValues(n_val=64), args)
    history = trainer.train()
    trainer.close()
    return history.records, os.path.exists(os.path.join(out, "metrics.csv"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_reduce_logged_values_across_ranks(tmp_path):
    (records0, wrote0), (records1, _) = run_ranks(_two_rank_metrics, out=str(tmp_path))
    assert records0 == records1 and wrote0  # identical histories; rank 0 wrote the CSV
    history = {}
    for record in records0:
        history.setdefault(record["name"], []).append((record["step"], record["value"]))
    # 8 steps (128 samples per rank, 16 per step). At step s rank r logged (r + 1) * s.
    assert history["r_mean"][:2] == [(2, 3.0), (4, 6.0)]  # mean over ranks of (1s, 2s)
    assert history["r_sum"][:2] == [(2, 6.0), (4, 12.0)]
    assert history["r_max"][:2] == [(2, 4.0), (4, 8.0)]
    assert history["r_min"][:2] == [(2, 2.0), (4, 4.0)]
    # Epoch values: over steps 1..8 on each rank, then over ranks.
    assert history["r_mean_epoch"] == [(8, 1.5 * 4.5)]  # mean of (1, 2) x mean of (1..8)
    assert history["r_sum_epoch"] == [(8, 3 * 36.0)]
    assert history["r_max_epoch"] == [(8, 16.0)]
    assert history["r_min_epoch"] == [(8, 1.0)]
    # Validation: each rank saw 2 batches of 16 samples; sum over batches and ranks.
    assert history["val_rank_sum"] == [(8, 2 * 1.0 + 2 * 2.0)]


class CountingMetric(torch.nn.Module):
    """The torchmetrics protocol (update, compute, reset), counting its computes."""

    def __init__(self, sync_on_compute: bool = True) -> None:
        super().__init__()
        self.sync_on_compute, self.computed = sync_on_compute, 0

    def update(self, value):
        pass

    def compute(self):
        self.computed += 1
        return torch.tensor(1.0)

    def reset(self):
        pass


def test_ranks_agree_on_metric_objects_before_any_compute():
    def gather_from(*other_ranks):
        return lambda names: [names, *other_ranks]

    collector, synced, local = MetricCollector(), CountingMetric(), CountingMetric(sync_on_compute=False)
    collector.log("acc", synced)
    collector.log("local", local)
    assert set(collector.pop_epoch(gather_from(["acc"]))) == {"acc", "local"}  # the other rank logged acc too
    collector.log("acc", synced)
    collector.log("local", local)
    with pytest.raises(MetricNotLoggedOnEveryRank, match=r"'acc' not on rank\(s\) \[1\]; 'f1' not on rank\(s\) \[0\]"):
        collector.pop_epoch(gather_from(["f1"]))
    assert synced.computed == 1 and local.computed == 1  # no compute() once the ranks disagree


class MetricOnOneRank(ToyModule):
    """Logs a torchmetrics MeanMetric on one rank only: in training (rank 0), in validation
    (rank 1), or one made with ``sync_on_compute=False`` (rank 0, allowed)."""

    def __init__(self, where: str) -> None:
        import torchmetrics

        super().__init__(n_val=64)
        self.where = where
        self.mean = torchmetrics.MeanMetric(sync_on_compute=where != "unsynced")

    def train_step(self, global_step, batch, device):
        if self.where in ("train", "unsynced") and torch.distributed.get_rank() == 0:
            self.mean.update(torch.tensor(float(global_step)))
            self.log("rank0_mean", self.mean)
        return super().train_step(global_step, batch, device)

    def val_step(self, global_step, batch, device):
        if self.where == "val" and torch.distributed.get_rank() == 1:
            self.mean.update(torch.tensor(2.0))
            self.log("rank1_val_mean", self.mean)
        return super().val_step(global_step, batch, device)


def _metric_on_one_rank(rank: int, out: str, where: str):
    args = make_args(out, backend="ddp", ddp_timeout=60.0)
    trainer = Trainer(MetricOnOneRank(where), args)
    try:
        trainer.train()
    except Exception as error:
        return type(error).__name__, str(error)
    return "finished", trainer.history.latest("rank0_mean")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("where", ["train", "val"])
def test_a_metric_object_logged_on_one_rank_stops_every_rank_with_its_name(tmp_path, where):
    """Its compute() gathers from every rank, and the rank that never logged it went on to other
    collectives: every rank waited for the whole ddp_timeout (600 s by default) and then blamed a
    stuck or dead rank. Every rank now raises at once, naming the metric, before any compute()."""
    results = run_ranks(_metric_on_one_rank, timeout=50, out=str(tmp_path), where=where)
    name, absent = ("rank0_mean", [1]) if where == "train" else ("rank1_val_mean", [0])
    for kind, message in results:
        assert kind == "MetricNotLoggedOnEveryRank"
        assert f"{name!r} not on rank(s) {absent}" in message and "sync_on_compute=False" in message
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_metric_object_that_does_not_sync_may_be_logged_on_one_rank(tmp_path):
    results = run_ranks(_metric_on_one_rank, out=str(tmp_path), where="unsynced")
    # rank 0's mean of global steps 0..7 (256 samples, 32 a step over both ranks), on every rank
    assert results == [("finished", 3.5), ("finished", 3.5)]


def test_the_loss_tracker_finds_the_first_nonfinite_step_only_when_a_read_was_not_finite():
    """A finite mean read back clears the losses it covers (no search in a healthy run); a
    non-finite read searches them, also across folds and the periodic search of unread ones."""
    import math

    from framework.metrics.loss_tracker import LossTracker

    tracker = LossTracker(torch.device("cpu"))
    tracker.start_epoch()
    for step in range(10):
        tracker.add(torch.tensor(1.0), step)
    tracker.after_read(float(tracker.interval_mean()))
    tracker.mark_logged()
    assert tracker.first_nonfinite_step() is None and not tracker._unchecked
    tracker._SEARCH_EVERY = 4  # unread stretches searched on the device every 4 micro-batches
    tracker._FOLD_EVERY = 2
    for step in range(10, 20):
        tracker.add(torch.tensor(float("nan") if step >= 13 else 1.0), step)
    mean = float(tracker.interval_mean())
    assert math.isnan(mean)
    tracker.after_read(mean)
    assert tracker.first_nonfinite_step() == 13
    assert tracker.state_dict()["first_nonfinite_step"] == 13


class LogsTrainLoss(ToyModule):
    """Logs its own ``train_loss`` (twice the loss: a value the framework never records) on every step."""

    def train_step(self, global_step, batch, device):
        loss = super().train_step(global_step, batch, device)
        self.log("train_loss", loss.detach() * 2, on_step=True)
        return loss


def test_a_user_log_of_a_framework_name_replaces_its_series_with_a_warning_naming_the_clash(tmp_path):
    trainer = Trainer(LogsTrainLoss(val_loaders=0), make_args(tmp_path, log_every_n_steps=2, epochs=2))
    with pytest.warns(UserWarning, match=r"self\.log\('train_loss'\) records the series 'train_loss', a name the framework"):
        trainer.train()
    steps = [record["step"] for record in trainer.history.records if record["name"] == "train_loss"]
    assert steps == sorted(set(steps)) and len(steps) == 8  # one series: one value per log point, not two
    epochs = [record for record in trainer.history.records if record["name"] == "train_loss_epoch"]
    assert len(epochs) == 2  # the user's epoch reduction, once per epoch
    plain = Trainer(ToyModule(val_loaders=0), make_args(tmp_path / "plain", log_every_n_steps=2, epochs=2))
    plain.train()
    ours = {r["step"]: r["value"] for r in plain.history.records if r["name"] == "train_loss"}
    theirs = {r["step"]: r["value"] for r in trainer.history.records if r["name"] == "train_loss"}
    assert theirs[2] != pytest.approx(ours[2])  # the user's value (twice a step loss), not the framework's
    with open(tmp_path / "run" / "metrics.csv", newline="") as handle:
        rows = [(int(row["step"]), float(row["value"])) for row in csv.DictReader(handle) if row["name"] == "train_loss"]
    assert rows == [(step, pytest.approx(theirs[step], rel=1e-6)) for step in steps]  # the CSV holds the one series
