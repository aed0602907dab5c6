"""Loop control: duration limits, evaluation schedule, schedulers, closures, TBPTT, gradients."""

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from toy import ToyModule, toy_args

from framework import Trainer
from framework.callbacks import Callback, StopTraining
from framework.loop.tbptt import split_along_time

# These tests run with the library's own seed, log level and checkpointing.
make_args = functools.partial(toy_args, train_batch_size=16, seed=42, log_level="INFO", checkpointer_args={})


def test_max_time_stops_training(tmp_path):
    class Slow(Callback):
        def on_end_optimizer_step(self, global_step):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            import time

            time.sleep(0.01)

    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=50, max_time=0.2), callbacks=[Slow()])
    trainer.train()
    assert 1 <= trainer.global_steps_finished < 50 * 16
    assert trainer.epochs_finished < 50


def test_mid_epoch_validation_schedule(tmp_path):
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=2, val_every_n_steps=5))
    trainer.train()
    # 16 steps per epoch: mid-epoch at 5, 10, 15, 20, 25, 30 and at both epoch ends (16, 32).
    assert [step for step, _ in trainer.history.steps("val_loss")] == [5, 10, 15, 16, 20, 25, 30, 32]


def test_validation_every_n_epochs_and_no_duplicate_at_epoch_end(tmp_path):
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=4, val_every_n_epochs=2, val_every_n_steps=16))
    trainer.train()
    assert [step for step, _ in trainer.history.steps("val_loss")] == [16, 32, 48, 64]
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path / "epochs_only", epochs=4, val_every_n_epochs=2))
    trainer.train()
    assert [step for step, _ in trainer.history.steps("val_loss")] == [32, 64]


def test_fast_dev_run_touches_every_hook_and_writes_nothing(tmp_path):
    seen = []

    class Seen(Callback):
        def on_end_train_step(self, global_step, *outputs):
            seen.append("train")

        def on_end_val_epoch(self, global_step, *outputs, key):
            seen.append(("val", outputs[0].shape[0]))

        def on_end_train(self, global_step):
            seen.append("end")

    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=10, fast_dev_run=True), callbacks=[Seen()])
    trainer.train()
    assert seen == ["train", ("val", 16), "end"]
    assert trainer.global_steps_finished == 1
    assert not os.path.exists(tmp_path / "run")


def test_sanity_validation_runs_before_training_without_recording(tmp_path):
    order = []

    class Watch(ToyModule):
        def val_step(self, global_step, batch, device):
            order.append(("val", global_step))
            return super().val_step(global_step, batch, device)

        def on_begin_train_epoch(self, global_step, epoch):
            order.append(("train", global_step))

    trainer = Trainer(Watch(scheduler=None), make_args(tmp_path, sanity_val_steps=2, max_val_steps_per_epoch=1))
    trainer.train()
    assert order[:2] == [("val", 0), ("train", 0)]  # min(sanity_val_steps, max_val_steps_per_epoch), as Lightning
    assert len(trainer.history.values("val_loss")) == 1


def test_epoch_interval_scheduler(tmp_path):
    trainer = Trainer(ToyModule(scheduler="step"), make_args(tmp_path, epochs=6, scheduler_interval="epoch"))
    trainer.train()
    # StepLR(step_size=3, gamma=0.5) stepped once per epoch: 6 epochs -> two decays.
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 0.05 * 0.25)


class PlateauModule(ToyModule):
    """Its loss has no gradient, so val_loss never improves."""

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)]

    def train_step(self, global_step, batch, device):
        return 0.0 * super().train_step(global_step, batch, device)


def test_reduce_lr_on_plateau_follows_the_monitored_metric(tmp_path):
    trainer = Trainer(PlateauModule(), make_args(tmp_path, epochs=3))
    trainer.train()
    # val_loss cannot improve: epochs 2 and 3 each halve the lr.
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 0.1 * 0.25)
    trainer = Trainer(PlateauModule(val_loaders=0), make_args(tmp_path / "no_val", epochs=1, val_every_n_steps=4))
    with pytest.raises(ValueError, match=r"scheduler_monitor='val_loss'"):
        trainer.train()


class LBFGSRegression(ToyModule):
    def __init__(self):
        super().__init__(val_loaders=0)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=generator)
        self.train_ds = TensorDataset(x, x @ torch.randn(16, 4, generator=generator))
        self.net = torch.nn.Linear(16, 4)
        self.evaluations = 0

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.LBFGS(self.parameters(), lr=1, max_iter=5)], []

    def train_step(self, global_step, batch, device):
        self.evaluations += 1
        x, y = batch
        return F.mse_loss(self.net(x), y)


def test_lbfgs_closure(tmp_path):
    module = LBFGSRegression()
    x, y = module.train_ds.tensors
    initial = F.mse_loss(module.net(x), y).item()
    trainer = Trainer(module, make_args(tmp_path, epochs=3, train_batch_size=64))
    trainer.train()
    assert trainer.global_steps_finished == 3
    assert module.evaluations > 3  # LBFGS re-evaluated the loss through the closure
    assert F.mse_loss(module.net(x), y).item() < 0.01 * initial
    with pytest.raises(ValueError, match="LBFGS re-evaluates the loss itself"):
        Trainer(LBFGSRegression(), make_args(tmp_path / "accumulating", train_batch_size=64, gpu_batch_size_limit=32)).train()


class SequenceModule(ToyModule):
    """An RNN regressing the running sum of its inputs; batches are [B, T, 1]."""

    def __init__(self):
        super().__init__(val_loaders=0, scheduler=None)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 12, 1, generator=generator)
        self.train_ds = TensorDataset(x, x.cumsum(1))
        self.rnn = torch.nn.RNN(1, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 1)
        self.seen = []

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.Adam(self.parameters(), lr=1e-2)], []

    def train_step(self, global_step, batch, device, hiddens=None):
        x, y = batch
        self.seen.append((x.shape[1], None if hiddens is None else hiddens.requires_grad))
        out, hiddens = self.rnn(x, hiddens)
        return F.mse_loss(self.head(out), y), hiddens


def test_truncated_backprop_through_time(tmp_path):
    module = SequenceModule()
    trainer = Trainer(module, make_args(tmp_path, epochs=1, train_batch_size=16, tbptt_steps=5))
    trainer.train()
    # 2 batches of 12 steps -> chunks 5, 5, 2; hidden state carried, detached; one optimizer step per batch.
    assert module.seen == [(5, None), (5, False), (2, False)] * 2
    assert trainer.global_steps_finished == 2


def test_split_along_time_keeps_structure():
    chunks = split_along_time({"x": torch.zeros(2, 7, 3), "lengths": torch.ones(2), "name": "a"}, 3)
    assert [c["x"].shape[1] for c in chunks] == [3, 3, 1]
    assert all(c["lengths"].shape == (2,) and c["name"] == "a" for c in chunks)


def test_split_along_time_without_a_time_dimension_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tbptt_steps=3 needs a tensor with 2\+ dims .* got a batch of type tuple with none"):
        split_along_time((torch.ones(4), torch.zeros(4)), 3)
    nested = split_along_time((torch.zeros(2, 4), (torch.ones(2), "id")), 2)  # parts without time are repeated
    assert [len(chunk[1]) for chunk in nested] == [2, 2]


def test_clip_grad_value_bounds_the_update(tmp_path):
    class Huge(ToyModule):
        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.SGD(self.parameters(), lr=1.0)], []

        def train_step(self, global_step, batch, device):
            return 1e6 * super().train_step(global_step, batch, device)

    module = Huge(val_loaders=0)
    before = [p.detach().clone() for p in module.parameters()]
    Trainer(module, make_args(tmp_path, max_steps=1, clip_grad_value=0.01)).train()
    change = max((p.detach() - b).abs().max().item() for p, b in zip(module.parameters(), before))
    assert 0.009 < change <= 0.01 + 1e-7


def test_track_grad_norm(tmp_path):
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=1, track_grad_norm=True, log_every_n_steps=4))
    trainer.train()
    steps = [step for step, _ in trainer.history.steps("grad_norm")]
    assert steps[:4] == [4, 8, 12, 16] and all(value > 0 for value in trainer.history.values("grad_norm"))


def test_stop_request_waits_for_min_epochs(tmp_path):
    class StopAtOnce(Callback):
        def on_end_train_epoch(self, global_step, *outputs):
            self.trainer.should_stop = True

    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=10, min_epochs=3), callbacks=[StopAtOnce()])
    trainer.train()
    assert trainer.epochs_finished == 3


def test_stop_training_exception_ends_the_run(tmp_path):
    class Raise(Callback):
        def on_end_optimizer_step(self, global_step):
            if global_step == 5:
                raise StopTraining("enough")

    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=10), callbacks=[Raise()])
    trainer.train()
    assert trainer.global_steps_finished == 5
