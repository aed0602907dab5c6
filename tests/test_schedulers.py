"""Schedulers as users write them: Lightning's per-scheduler dicts (interval, frequency,
monitor), checked against a hand-written loop on sp and on 2 gloo ranks; ReduceLROnPlateau
once per epoch; a missing monitored metric names what exists; exact resume; the start log."""

import math
from typing import List

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from toy import ToyModule, flat_parameters

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.loop.schedulers import LRSchedules, ScheduledLR, scheduled_lr

EPOCHS, BATCH, N_TRAIN, LR = 3, 16, 128, 0.05
STEPS_PER_EPOCH = N_TRAIN // BATCH


def make_args(out, **overrides) -> TrainerArguments:
    values = dict(
        epochs=EPOCHS,
        train_batch_size=BATCH,
        seed=3,
        disable_tqdm=True,
        log_level="INFO",
        output_dir=str(out),
        ddp_timeout=30,
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    values.update(overrides)
    return TrainerArguments(**values)


def two_schedules(optimizer):
    """A per-epoch StepLR every 2 epochs and a per-step ExponentialLR every 3 steps (chained)."""
    return [
        {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "epoch", "frequency": 2},
        {"scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97), "interval": "step", "frequency": 3},
    ]


class Scheduled(ToyModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(n_train=N_TRAIN, lr=LR, val_loaders=0, **kwargs)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], two_schedules(optimizer)


class RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: List[float] = []

    def on_end_optimizer_step(self, global_step):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def hand_written(module: ToyModule, seed: int) -> List[float]:
    """The same schedule written out: returns the lr after every optimizer step."""
    optimizer = torch.optim.SGD(module.parameters(), lr=module.lr, momentum=0.9)
    per_epoch, per_step = (entry["scheduler"] for entry in two_schedules(optimizer))
    lrs, step = [], 0
    for epoch in range(EPOCHS):
        order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, N_TRAIN, BATCH):
            x, y = module.train_ds[order[start : start + BATCH]]
            F.cross_entropy(module.net(x), y).backward()
            optimizer.step()
            step += 1
            if step % 3 == 0:
                per_step.step()
            optimizer.zero_grad(set_to_none=True)
            lrs.append(optimizer.param_groups[0]["lr"])
        if (epoch + 1) % 2 == 0:
            per_epoch.step()
    return lrs


def test_scheduler_dicts_step_as_a_hand_written_loop_on_one_process(tmp_path):
    module, reference, recorder = Scheduled(), Scheduled(), RecordLR()
    Trainer(module, make_args(tmp_path), callbacks=[recorder]).train()
    expected = hand_written(reference, seed=3)
    assert recorder.lrs == expected
    assert torch.equal(flat_parameters(module), flat_parameters(reference))
    assert expected[-1] == pytest.approx(LR * 0.5 * 0.97 ** (EPOCHS * STEPS_PER_EPOCH // 3))


def _scheduled_rank(rank, out):
    module, recorder = Scheduled(), RecordLR()
    trainer = Trainer(module, make_args(out, backend="ddp"), callbacks=[recorder])
    trainer.train()
    trainer.close()
    return recorder.lrs, flat_parameters(module)


@pytest.mark.distributed
def test_scheduler_dicts_step_as_a_hand_written_loop_on_two_ranks(tmp_path):
    reference = Scheduled()
    expected = hand_written(reference, seed=3)
    for lrs, parameters in run_ranks(_scheduled_rank, out=str(tmp_path)):
        assert lrs == expected
        assert torch.allclose(parameters, flat_parameters(reference), atol=1e-5)


class Ported(ToyModule):
    """A per-epoch StepLR as written for Lightning, bare or as a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__(n_train=64, val_loaders=0, lr=LR)
        self.as_dict = as_dict

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": "epoch"} if self.as_dict else scheduler]


def test_a_per_epoch_steplr_decays_per_epoch_with_the_dict(tmp_path, framework_log):
    bare = Trainer(Ported(as_dict=False), make_args(tmp_path / "bare"))
    bare.train()
    assert bare.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** (3 * 4))  # per step (default)
    framework_log.clear()
    ported = Trainer(Ported(as_dict=True), make_args(tmp_path / "dict"))
    ported.train()
    assert ported.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)
    assert "scheduler 0: StepLR, every epoch" in framework_log
    assert isinstance(ported.schedulers[0], torch.optim.lr_scheduler.StepLR)  # the raw objects


class Plateau(ToyModule):
    """val_loss cannot improve (no gradient); the plateau's dict (or none) is given."""

    def __init__(self, entry=None, **kwargs) -> None:
        super().__init__(n_train=64, n_val=16, **kwargs)
        self.entry = entry

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return [optimizer], [plateau if self.entry is None else {"scheduler": plateau, **self.entry}]

    def train_step(self, global_step, batch, device):
        return 0.0 * super().train_step(global_step, batch, device)


def test_plateau_steps_once_per_epoch_despite_mid_epoch_validations(tmp_path, framework_log):
    # 4 steps per epoch, validation after steps 1, 2, 3 and 4 of every epoch.
    trainer = Trainer(Plateau(), make_args(tmp_path, val_every_n_steps=1))
    trainer.train()
    assert len(trainer.history.values("val_loss")) == 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # epochs 2 and 3 do not improve
    assert "scheduler 0: ReduceLROnPlateau on val_loss, every epoch" in framework_log


def test_plateau_with_interval_step_follows_every_validation(tmp_path, framework_log):
    trainer = Trainer(Plateau({"interval": "step", "frequency": 2}), make_args(tmp_path, val_every_n_steps=1))
    trainer.train()
    # Stepped after the validations at steps 2, 4, ..., 12: the first sets the best, 5 more halve.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5)
    assert "scheduler 0: ReduceLROnPlateau on val_loss, after every validation at a multiple of 2 steps" in framework_log


def test_plateau_every_second_epoch_and_epochs_without_validation(tmp_path):
    trainer = Trainer(Plateau({"frequency": 2}), make_args(tmp_path, epochs=6))
    trainer.train()
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # epochs 2, 4, 6: best, worse, worse
    # Validation every 2 epochs: the epochs between record no val_loss and are skipped, not an error.
    trainer = Trainer(Plateau(), make_args(tmp_path / "sparse", epochs=6, val_every_n_epochs=2))
    trainer.train()
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_a_missing_monitored_metric_names_it_and_the_metrics_that_exist(tmp_path):
    trainer = Trainer(Plateau({"monitor": "val_acc"}), make_args(tmp_path))
    with pytest.raises(ValueError, match=r"monitors 'val_acc' \(\"monitor\": 'val_acc'\).*recorded metrics: \[.*'val_loss'"):
        trainer.train()
    trainer = Trainer(Plateau(), make_args(tmp_path / "default", scheduler_monitor="val_acc"))
    with pytest.raises(ValueError, match=r"scheduler_monitor='val_acc'"):
        trainer.train()


def test_manual_optimization_never_steps_schedulers(tmp_path, framework_log):
    class Manual(Scheduled):
        automatic_optimization = False

        def train_step(self, global_step, batch, device):
            optimizer = self.optimizers()
            x, y = batch
            self.manual_backward(F.cross_entropy(self.net(x), y))
            optimizer.step()
            optimizer.zero_grad()
            return torch.zeros(())

    trainer = Trainer(Manual(), make_args(tmp_path))
    trainer.train()
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    assert [s.last_epoch for s in trainer.schedulers] == [0, 0]
    assert "scheduler 0: StepLR, stepped by train_step (manual optimization)" in framework_log


def test_resume_mid_epoch_keeps_frequencies_exact(tmp_path):
    saving = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=0, save_at_end=True, resume="auto")
    reference, recorder = Scheduled(dropout=0.1), RecordLR()
    Trainer(reference, make_args(tmp_path / "reference"), callbacks=[recorder]).train()
    for stop in (10, 16):  # mid-epoch 2 (between frequency points) and the end of epoch 2
        first = Scheduled(dropout=0.1)
        Trainer(first, make_args(tmp_path / f"first{stop}", max_steps=stop, checkpointer_args=saving)).train()
        resumed, again = Scheduled(dropout=0.1), RecordLR()
        Trainer(resumed, make_args(tmp_path / f"first{stop}", checkpointer_args=saving), callbacks=[again]).train()  # continued
        assert again.lrs == recorder.lrs[stop:]
        assert torch.equal(flat_parameters(resumed), flat_parameters(reference))
        for path in (tmp_path / "ckpt").iterdir():
            path.unlink()


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"interval": "batch"}, r"scheduler 0 has interval='batch'; allowed: 'step' or 'epoch'"),
        ({"frequency": 0}, r"frequency=0; allowed: an integer >= 1"),
        ({"monitor": 3}, r"monitor=3; allowed: a metric name"),
        ({"every": 2}, r"unknown key\(s\) \['every'\]; allowed keys"),
    ],
)
def test_bad_scheduler_dicts_name_the_key_and_what_is_allowed(entry, message):
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with pytest.raises((TypeError, ValueError), match=message):
        scheduled_lr({"scheduler": scheduler, **entry}, 0, "step", "val_loss")
    with pytest.raises(ValueError, match="without 'scheduler'"):
        scheduled_lr({"interval": "step"}, 0, "step", "val_loss")


def test_describe_and_bare_defaults():
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    onecycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    schedules = LRSchedules([scheduled_lr(onecycle, 0, "step", "val_loss"), scheduled_lr(plateau, 1, "step", "val_loss")])
    assert schedules.describe() == [
        "scheduler 0: OneCycleLR, every step",
        "scheduler 1: ReduceLROnPlateau on val_loss, every epoch",
    ]
    assert ScheduledLR(onecycle, "step", frequency=4).describe(2) == "scheduler 2: OneCycleLR, every 4 steps"
    assert schedules.schedulers == [onecycle, plateau]
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.1 / 25)
