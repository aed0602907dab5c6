"""The sanity validation before training (``sanity_val_steps``, on by default as in Lightning)."""

import functools

import pytest
import torch

from toy import ToyModule, toy_args

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback

make_args = functools.partial(toy_args, train_batch_size=16, epochs=2, max_val_steps_per_epoch=2, sanity_val_steps=2)


def test_it_is_on_by_default_as_in_lightning():
    assert TrainerArguments().sanity_val_steps == 2  # Lightning's num_sanity_val_steps


class Events(Callback):
    """What happened, in order: optimizer steps, validation batches and recorded metrics."""

    def __init__(self) -> None:
        self.seen = []

    def on_end_optimizer_step(self, global_step):
        self.seen.append("step")

    def on_log_metrics(self, global_step, metrics):
        self.seen.append("metrics")

    def on_end_val_epoch(self, global_step, *outputs, key=""):
        self.seen.append("val_epoch")


def test_the_default_runs_two_batches_and_changes_nothing_in_the_result(tmp_path):
    # Dropout draws from torch's RNG each step and the val loader's iterator draws a seed:
    # without the RNG restore the weights and losses differ (mutant: drop restore_rng_state).
    def run(name, **overrides):
        module = ToyModule(dropout=0.3, scheduler=None)
        counted = []
        original = module.val_step
        module.val_step = lambda *a: counted.append(1) or original(*a)
        trainer = Trainer(module, make_args(tmp_path / name, log_every_n_steps=1, **overrides))
        trainer.train()
        weights = [p.detach().clone() for p in module.parameters()]
        return weights, trainer.history, len(counted)

    on_weights, on_history, on_batches = run("on")
    off_weights, off_history, off_batches = run("off", sanity_val_steps=0)
    assert on_batches == off_batches + 2  # two extra val batches, before training
    assert all(torch.equal(a, b) for a, b in zip(on_weights, off_weights))
    for name in ("train_loss", "val_loss"):
        assert on_history.values(name) == off_history.values(name) and off_history.values(name)


@pytest.mark.parametrize("broken", ["returns_no_loss", "raises"])
def test_a_broken_val_step_fails_before_the_first_optimizer_step(tmp_path, broken):
    # Mutant: sanity_check_due always False -> an epoch of optimizer steps runs first.
    class Broken(ToyModule):
        def val_step(self, global_step, batch, device):
            if broken == "raises":
                raise ValueError("bad val_step")
            return {"outputs": super().val_step(global_step, batch, device)}  # a dict without "loss"
            # (None is Lightning's usual return, accepted: see test_lightning_vocabulary.py)

    events = Events()
    module = Broken(scheduler=None)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises((TypeError, ValueError)) as caught:
        Trainer(module, make_args(tmp_path), callbacks=[events]).train()
    assert events.seen == []  # no step, no metric
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "sanity validation of 2 batch(es)" in notes and "sanity_val_steps=0" in notes


def test_sanity_records_nothing_and_zero_turns_it_off(tmp_path):
    # Mutant: run it for sanity_val_steps >= 0 (0 batches means the whole loader there).
    def val_calls(name, **overrides):
        module, events = ToyModule(scheduler=None), Events()
        calls = []
        original = module.val_step
        module.val_step = lambda *a: calls.append(len(events.seen)) or original(*a)
        Trainer(module, make_args(tmp_path / name, epochs=1, **overrides), callbacks=[events]).train()
        return calls, events.seen

    calls, seen = val_calls("default")
    assert calls[:2] == [0, 0] and len(calls) == 4  # 2 sanity batches before anything was recorded, 2 at epoch end
    assert seen.count("val_epoch") == 2 and seen[0] == "val_epoch"  # hooks run, as in Lightning; nothing recorded
    calls, _ = val_calls("off", sanity_val_steps=0)
    assert len(calls) == 2 and calls[0] > 0
    calls, _ = val_calls("fast", fast_dev_run=True)  # fast_dev_run validates one batch itself
    assert len(calls) == 1 and calls[0] > 0


def test_a_resumed_run_skips_it(tmp_path):
    # It validated before it was saved. Mutant: drop the global_steps_finished == 0 condition.
    from framework.checkpoint import DefaultCheckpointerArguments

    def run(epochs):
        module, events = ToyModule(scheduler=None), Events()
        calls = []
        original = module.val_step
        module.val_step = lambda *a: calls.append(len(events.seen)) or original(*a)
        checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
        Trainer(module, make_args(tmp_path, epochs=epochs, checkpoints=checkpoints), callbacks=[events]).train()
        return calls

    assert run(1)[:2] == [0, 0]  # fresh: the check runs first
    resumed = run(2)
    assert len(resumed) == 2 and resumed[0] > 0  # resumed: only epoch 2's validation, after its steps
