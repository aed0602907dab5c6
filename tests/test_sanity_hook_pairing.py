"""Lightning's loop scenarios with a module that pairs its validation hooks, sanity check on.

A user's module opens its per-epoch state in ``on_begin_val_epoch`` (a list its ``val_step``
appends to) and closes it in ``on_end_val_epoch``, as Lightning programs do. Lightning's sanity
check runs the whole validation loop, hooks included, with ``trainer.sanity_checking`` true; so
does ours, and nothing it logs is recorded. Each scenario follows one of Lightning's loop tests:
plain, batch limits, ``check_val_every_n_epoch``, early stopping, early stopping mid-epoch (a
validation every N steps) and a resume at an epoch's last step.

Fault caught: a sanity check that calls ``val_step`` without the epoch hooks (mutant: the
evaluator's hooks called only when ``record``) -> IndexError in the module's own ``val_step``;
one that records what a hook records with ``trainer.log_metrics`` (mutant: the recorder ignores
``sanity_checking``) -> the history holds it. (What the steps and hooks ``self.log`` is dropped
twice over, by the evaluator and by the recorder; early stopping below checks the result.)
"""

import functools
from typing import Any, List, Tuple

import pytest
import torch

from toy import ToyModule, toy_args

from framework import Trainer
from framework.callbacks import Callback, EarlyStopping
from framework.checkpoint import DefaultCheckpointerArguments

# 256 samples / 32 = 8 steps per epoch; 64 val samples / 16 = 4 val batches.
make_args = functools.partial(toy_args, train_batch_size=32, val_batch_size=16, sanity_val_steps=2, epochs=2)


class HookPairing(ToyModule):
    """A user's module: each validation epoch's batch losses gathered between its two hooks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scheduler=None, **kwargs)
        self.val_epochs: List[List[torch.Tensor]] = []  # one list per validation epoch, opened by the begin hook
        self.closed: List[Tuple[bool, int, int]] = []  # (sanity_checking, global_step, batches) per closed epoch
        self.open = False

    def on_begin_val_epoch(self, global_step, key):
        assert not self.open, "on_begin_val_epoch twice without on_end_val_epoch"
        self.open = True
        self.val_epochs.append([])

    def val_step(self, global_step, batch, device):
        losses, correct = super().val_step(global_step, batch, device)
        self.val_epochs[-1].append(losses.mean())  # IndexError when the begin hook was skipped
        return losses, correct

    def on_end_val_epoch(self, global_step, *outputs, key):
        assert self.open, "on_end_val_epoch without on_begin_val_epoch"
        self.open = False
        batches = self.val_epochs[-1]
        self.log("score", float(len(self.val_epochs)))  # 1 in the sanity check, then 2, 3...: lowest first
        self.log("val_batch_mean", torch.stack(batches).mean())
        self.closed.append((self.trainer.sanity_checking, global_step, len(batches)))


def train(module: HookPairing, args, callbacks=()) -> Trainer:
    trainer = Trainer(module, args, callbacks=list(callbacks))
    trainer.train()
    assert not module.open  # every begin was paired with an end
    return trainer


def recorded_steps(trainer: Trainer, name: str) -> List[int]:
    return [record["step"] for record in trainer.history.records if record["name"] == name]


class LogsFromAHook(Callback):
    """A callback recording a host value after each validation (as a user's callback may)."""

    def on_end_val_epoch(self, global_step, *outputs, key):
        self.trainer.log_metrics({"validations_seen": 1.0})


def test_plain(tmp_path):
    module = HookPairing()
    trainer = train(module, make_args(tmp_path), callbacks=[LogsFromAHook()])
    assert module.closed == [(True, 0, 2), (False, 8, 4), (False, 16, 4)]  # the sanity check: 2 batches, flag on
    assert recorded_steps(trainer, "score") == [8, 16]  # nothing the sanity check logged was recorded
    assert recorded_steps(trainer, "validations_seen") == [8, 16]  # trainer.log_metrics from a hook neither
    assert recorded_steps(trainer, "val_loss") == [8, 16]
    assert trainer.sanity_checking is False
    with pytest.raises(AttributeError, match="read-only"):
        trainer.sanity_checking = True  # type: ignore[misc]


def test_batch_limits(tmp_path):
    # limit_train_batches=3, limit_val_batches=1: the sanity check runs the smaller of its 2 and the limit.
    module = HookPairing()
    args = make_args(tmp_path, max_train_steps_per_epoch=3, max_val_steps_per_epoch=1)
    trainer = train(module, args)
    assert module.closed == [(True, 0, 1), (False, 3, 1), (False, 6, 1)]
    assert trainer.global_steps_finished == 6


def test_check_val_every_n_epoch(tmp_path):
    module = HookPairing()
    trainer = train(module, make_args(tmp_path, epochs=3, val_every_n_epochs=2))
    assert module.closed == [(True, 0, 2), (False, 16, 4)]  # the sanity check runs whatever the schedule
    assert recorded_steps(trainer, "score") == [16]


def test_early_stopping_ignores_the_sanity_values(tmp_path):
    # score is lowest (1) in the sanity check: had it been recorded, epoch 1 (2) would be no
    # improvement and patience=1 would stop after one epoch.
    module, stopper = HookPairing(), EarlyStopping(monitor="score", mode="min", patience=1)
    trainer = train(module, make_args(tmp_path, epochs=5), callbacks=[stopper])
    assert stopper.best == 2.0 and stopper.best_step == 8 and stopper.stopped_step == 16
    assert trainer.epochs_finished == 2
    assert module.closed == [(True, 0, 2), (False, 8, 4), (False, 16, 4)]


def test_early_stopping_mid_epoch(tmp_path):
    # Validation every 3 steps (val_check_interval): the stop comes inside epoch 1.
    module, stopper = HookPairing(), EarlyStopping(monitor="score", mode="min", patience=1)
    args = make_args(tmp_path, epochs=3, val_every_n_steps=3, val_every_n_epochs=0)
    trainer = train(module, args, callbacks=[stopper])
    assert stopper.stopped_step == 6 and trainer.global_steps_finished == 6 and trainer.epochs_finished == 0
    assert module.closed == [(True, 0, 2), (False, 3, 4), (False, 6, 4)]


class StopAtEpochEndValidation(Callback):
    """Kills the first run after the checkpoint of the epoch's last step, before its validation."""

    def on_begin_val_epoch(self, global_step, key):
        if not self.trainer.sanity_checking:
            raise KeyboardInterrupt("killed")


def test_resume_at_an_epochs_last_step(tmp_path):
    checkpoints = DefaultCheckpointerArguments(period=0, save_every_n_steps=8, save_at_end=False, resume="auto")
    first = HookPairing()
    with pytest.raises(KeyboardInterrupt):
        Trainer(first, make_args(tmp_path, checkpoints=checkpoints), callbacks=[StopAtEpochEndValidation()]).train()
    assert first.closed == [(True, 0, 2)]
    resumed = HookPairing()
    trainer = train(resumed, make_args(tmp_path, checkpoints=checkpoints))
    # The resumed run starts at step 8 with the epoch's batches done: its validation, then epoch 2.
    assert resumed.closed == [(False, 8, 4), (False, 16, 4)]  # no sanity check on a resume
    assert recorded_steps(trainer, "score") == [8, 16]
