"""The core loop on the sp backend: parity with a hand-written loop, counting, hooks, metrics."""

import csv
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from toy import ToyModule, flat_parameters, toy_args

from framework import Stage, Trainer
from framework.callbacks import Callback

# These tests run with the library's own seed, log level and checkpointing.
make_args = functools.partial(toy_args, log_every_n_steps=2, seed=42, log_level="INFO", checkpointer_args={})


def hand_written_loop(module: ToyModule, epochs: int, batch: int, micro: int, max_norm: float, seed: int) -> None:
    """What the framework should compute, written out as plain PyTorch."""
    optimizer = torch.optim.SGD(module.parameters(), lr=module.lr, momentum=0.9)
    n = len(module.train_ds)
    micro_batches = math.ceil(n / micro)
    steps_per_epoch = math.ceil(micro_batches / (batch // micro))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=module.lr, total_steps=steps_per_epoch * epochs)
    accumulation = batch // micro
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for cycle_start in range(0, micro_batches, accumulation):
            cycle = range(cycle_start, min(cycle_start + accumulation, micro_batches))
            for index in cycle:
                x, y = module.train_ds[order[index * micro : (index + 1) * micro]]
                loss = F.cross_entropy(module.net(x), y)
                (loss / len(cycle)).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("n_train", [256, 264])  # 264: the last accumulation cycle is partial
def test_sp_matches_hand_written_loop(tmp_path, n_train):
    framework_module, reference = ToyModule(n_train=n_train), ToyModule(n_train=n_train)
    assert torch.equal(flat_parameters(framework_module), flat_parameters(reference))
    args = make_args(tmp_path, epochs=3, train_batch_size=32, gpu_batch_size_limit=8, clip_grads=True, max_grad_norm=0.5, seed=7)
    trainer = Trainer(framework_module, args)
    assert (trainer.gradient_accumulation, trainer.train_step_batch_size) == (4, 8)
    trainer.train()
    hand_written_loop(reference, epochs=3, batch=32, micro=8, max_norm=0.5, seed=7)
    difference = (flat_parameters(framework_module) - flat_parameters(reference)).abs().max().item()
    assert difference <= 1e-6
    expected_steps = math.ceil(math.ceil(n_train / 8) / 4)
    assert trainer.estimated_global_steps_per_epoch == expected_steps
    assert trainer.global_steps_finished == 3 * expected_steps
    # OneCycleLR ends exactly on its last step (one more would raise).
    assert trainer.schedulers[0].last_epoch == 3 * expected_steps


def test_max_steps_and_per_epoch_limits_are_exact(tmp_path):
    module = ToyModule(scheduler=None)
    counted = {"val_batches": 0}
    original_val_step = module.val_step

    def counting_val_step(*arguments):
        counted["val_batches"] += 1
        return original_val_step(*arguments)

    module.val_step = counting_val_step
    args = make_args(tmp_path, epochs=5, train_batch_size=16, max_train_steps_per_epoch=3, max_val_steps_per_epoch=2)
    trainer = Trainer(module, args)
    trainer.train()
    assert trainer.global_steps_finished == 15
    assert trainer.epochs_finished == 5
    assert counted["val_batches"] == 5 * 2

    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path / "max_steps", epochs=5, train_batch_size=16, max_steps=7))
    trainer.train()
    assert trainer.global_steps_finished == 7


def test_fractional_step_limit(tmp_path):
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, train_batch_size=16, max_train_steps_per_epoch=0.25))
    assert trainer.estimated_global_steps_per_epoch == 4  # 256 / 16 = 16 steps, a quarter
    trainer.train()
    assert trainer.global_steps_finished == 4


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_begin_train(self, global_step):
        self.calls.append(("on_begin_train", global_step))

    def on_begin_train_epoch(self, global_step, epoch):
        self.calls.append(("on_begin_train_epoch", global_step, epoch))

    def on_end_backward(self, global_step, loss):
        assert loss.requires_grad is False or loss.grad_fn is not None
        self.calls.append(("on_end_backward", global_step))

    def on_end_train_step(self, global_step, *outputs):
        assert isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 0
        self.calls.append(("on_end_train_step", global_step))

    def on_end_optimizer_step(self, global_step):
        self.calls.append(("on_end_optimizer_step", global_step))

    def on_end_train_epoch(self, global_step, *outputs):
        self.calls.append(("on_end_train_epoch", global_step, len(outputs)))

    def on_begin_val_epoch(self, global_step, key):
        self.calls.append(("on_begin_val_epoch", global_step, key))

    def on_end_val_epoch(self, global_step, *outputs, key):
        self.calls.append(("on_end_val_epoch", global_step, key, tuple(o.shape for o in outputs)))

    def on_end_train(self, global_step):
        self.calls.append(("on_end_train", global_step))


class RecordingModule(ToyModule):
    def __init__(self, log, **kwargs):
        super().__init__(**kwargs)
        self.hook_log = log

    def on_begin_train_epoch(self, global_step, epoch):
        self.hook_log.append(("module", "on_begin_train_epoch", epoch))


def test_hooks_order_and_arguments(tmp_path):
    module_log = []
    recorder = Recorder()
    module = RecordingModule(module_log, n_train=32, n_val=12, scheduler=None)
    args = make_args(tmp_path, epochs=2, train_batch_size=16, gpu_batch_size_limit=8)
    Trainer(module, args, callbacks=[recorder]).train()
    per_epoch = lambda epoch, start: [  # noqa: E731
        ("on_begin_train_epoch", start, epoch),
        ("on_end_backward", start),
        ("on_end_train_step", start),
        ("on_end_backward", start),
        ("on_end_train_step", start),
        ("on_end_optimizer_step", start + 1),
        ("on_end_backward", start + 1),
        ("on_end_train_step", start + 1),
        ("on_end_backward", start + 1),
        ("on_end_train_step", start + 1),
        ("on_end_optimizer_step", start + 2),
        ("on_end_train_epoch", start + 2, 0),
        ("on_begin_val_epoch", start + 2, ""),
        ("on_end_val_epoch", start + 2, "", (torch.Size([12]), torch.Size([12]))),
    ]
    assert recorder.calls == [("on_begin_train", 0), *per_epoch(0, 0), *per_epoch(1, 2), ("on_end_train", 4)]
    assert module_log == [("module", "on_begin_train_epoch", 0), ("module", "on_begin_train_epoch", 1)]


def test_multiple_validation_loaders_reported_under_their_keys(tmp_path):
    trainer = Trainer(ToyModule(val_loaders=2, scheduler=None), make_args(tmp_path, epochs=2, train_batch_size=32))
    trainer.train()
    assert len(trainer.history.values("val_loss/set0")) == 2
    assert trainer.history.values("val_loss/set0") == trainer.history.values("val_loss/set1")
    assert trainer.validate().keys() == {"val_loss/set0", "val_loss/set1"}


def test_metrics_history_and_csv(tmp_path):
    trainer = Trainer(ToyModule(scheduler=None), make_args(tmp_path, epochs=2, train_batch_size=32, log_every_n_steps=4))
    history = trainer.train()
    assert [step for step, _ in history.steps("train_loss")] == [4, 8, 12, 16]
    assert len(history.values("val_loss")) == 2 and history.values("val_loss")[1] < history.values("val_loss")[0] + 0.5
    with open(tmp_path / "run" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(r["step"]), r["name"], float(r["value"])) for r in rows] == [
        (r["step"], r["name"], r["value"]) for r in history.records
    ]


def test_train_outputs_are_kept_only_when_asked(tmp_path):
    recorder = Recorder()
    args = make_args(tmp_path, train_batch_size=32, collect_train_outputs=True)
    Trainer(ToyModule(scheduler=None, val_loaders=0), args, callbacks=[recorder]).train()
    assert ("on_end_train_epoch", 8, 1) in recorder.calls


class DictBatchModule(ToyModule):
    """Batches are dicts of nested tensors; the step also returns a dict."""

    def get_train_dataloader(self, sampler, batch_size):
        def collate(items):
            x = torch.stack([item[0] for item in items])
            y = torch.stack([item[1] for item in items])
            return {"inputs": {"x": x}, "target": [y]}

        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds), collate_fn=collate)

    def train_step(self, global_step, batch, device):
        assert batch["inputs"]["x"].device.type == device.type
        loss = F.cross_entropy(self.net(batch["inputs"]["x"]), batch["target"][0])
        return {"loss": loss, "batch_size": batch["target"][0].shape[0]}


def test_nested_batches_and_dict_outputs(tmp_path):
    trainer = Trainer(DictBatchModule(val_loaders=0, scheduler=None), make_args(tmp_path, train_batch_size=32))
    trainer.train()
    assert trainer.global_steps_finished == 8


def test_same_run_twice_gives_same_weights(tmp_path):
    results = []
    for run in range(2):
        module = ToyModule(dropout=0.2)
        Trainer(module, make_args(tmp_path / str(run), epochs=2, train_batch_size=32)).train()
        results.append(flat_parameters(module))
    assert torch.equal(results[0], results[1])


def test_sampler_shuffles_per_epoch_and_orders_validation(tmp_path):
    seen = {"train": [], "val": None}

    class Spy(ToyModule):
        def get_train_dataloader(self, sampler, batch_size):
            loader = super().get_train_dataloader(sampler, batch_size)
            seen["sampler"] = loader.sampler
            return loader

        def get_val_dataloaders(self, sampler, batch_size):
            seen["val"] = list(sampler(self.val_ds))
            return super().get_val_dataloaders(sampler, batch_size)

    trainer = Trainer(Spy(scheduler=None), make_args(tmp_path, epochs=1, train_batch_size=32))
    trainer.train()
    sampler = seen["sampler"]
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(256))
    assert seen["val"] == list(range(64))


def test_test_stage_uses_test_loaders(tmp_path):
    class WithTest(ToyModule):
        def get_test_dataloaders(self, sampler, batch_size):
            return {"holdout": DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))}

    trainer = Trainer(WithTest(scheduler=None), make_args(tmp_path, train_batch_size=32))
    results = trainer.test()
    assert set(results) == {"test_loss/holdout"} and results["test_loss/holdout"] > 0
    assert Stage.TEST.value == "test"
