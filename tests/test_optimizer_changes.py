"""Optimizer changes on resume (framework/loop/optimizer_changes.py): another class is an error, a
changed hyperparameter a warning (the configured value is used), a scheduled lr no change.

Real trainers write a checkpoint; the same directory is resumed with other optimizers.
"""

import os

import pytest
import torch

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.loop.module_checks import CheckpointMismatch


class Configurable(ToyModule):
    """The toy MLP with the optimizer chosen by arguments; StepLR halves lr every step when scheduled."""

    def __init__(self, kind="sgd", lr=0.1, momentum=0.0, scheduled=True):
        super().__init__(n_train=64, scheduler=None)
        self.kind, self.lr, self.momentum, self.scheduled = kind, lr, momentum, scheduled

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        if self.kind == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)] if self.scheduled else []
        return [optimizer], schedulers


def train(directory, module, max_steps):
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    trainer = Trainer(module, toy_args(directory, checkpoints, epochs=4, max_steps=max_steps))
    trainer.train()
    return trainer


@pytest.fixture
def saved(tmp_path):
    """A run of SGD (momentum 0, lr 0.1 halved every step) stopped after 2 steps, with its checkpoint."""
    train(tmp_path, Configurable(), max_steps=2)
    return tmp_path


def test_another_optimizer_class_is_an_error_before_step_one_naming_both(saved):
    folder = saved / "run" / "checkpoints"
    before = sorted(os.listdir(folder))
    with pytest.raises(CheckpointMismatch) as refused:
        train(saved, Configurable(kind="adam"), max_steps=4)
    message = str(refused.value)
    assert "optimizer 0 of class SGD (torch.optim.sgd.SGD)" in message and "now returns Adam (torch.optim.adam.Adam)" in message
    assert "reset_optimizers_schedulers" in message and "KeyError" not in message
    assert sorted(os.listdir(folder)) == before  # no step was taken, nothing written


def test_a_changed_momentum_is_warned_and_used_while_the_scheduled_lr_resumes(saved, framework_log):
    trainer = train(saved, Configurable(momentum=0.9), max_steps=3)
    group = trainer.optimizers[0].param_groups[0]
    assert group["momentum"] == 0.9
    assert trainer.optimizers[0].state[next(iter(trainer.module.parameters()))]["momentum_buffer"] is not None
    assert group["lr"] == pytest.approx(0.1 * 0.5**3)  # the checkpoint's schedule went on: not flagged
    warnings = [line for line in framework_log if "in the checkpoint and" in line]
    assert warnings == [
        "optimizer 0 (SGD): momentum is 0.0 in the checkpoint and 0.9 in this run's configuration; using the configured 0.9"
    ]


def test_an_unscheduled_lr_change_is_warned_and_used(tmp_path, framework_log):
    train(tmp_path, Configurable(scheduled=False), max_steps=2)
    trainer = train(tmp_path, Configurable(lr=0.05, scheduled=False), max_steps=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05
    assert any(
        "lr is 0.1 in the checkpoint and 0.05 in this run's configuration; using the configured 0.05" in line
        for line in framework_log
    )


def test_a_changed_base_of_the_schedule_is_warned_and_the_checkpoints_schedule_kept(saved, framework_log):
    trainer = train(saved, Configurable(lr=0.2), max_steps=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert any(
        "initial_lr is 0.1 in the checkpoint and 0.2 in this run's schedule; the checkpoint's schedule is kept" in line
        for line in framework_log
    )
