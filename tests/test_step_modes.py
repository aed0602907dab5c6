"""The step modes (``framework/loop/steps/``): one class per mode, chosen once; what only they do.

- which class a configuration gets, and that ``TrainingStep.run`` is that class's own ``run``;
- ``no_sync``: every micro-batch (and TBPTT chunk) but a cycle's last skips the gradient sync,
  and a stream, whose last micro-batch is not known ahead, syncs every one;
- a stream ending inside an accumulation cycle steps on the mean over the micro-batches it saw.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from toy import ToyModule, flat_parameters, toy_args

from backends import FullPrecision, SingleProcess, TrainerBackend
from framework import Trainer
from framework.loop.steps.automatic import AutomaticStep
from framework.loop.steps.closure import ClosureStep
from framework.loop.steps.manual import ManualStep
from framework.loop.steps.tbptt import TBPTTStep

make_args = functools.partial(toy_args, epochs=1)


class SyncFlags(SingleProcess):
    """Records ``skip_gradient_sync`` of every ``no_sync`` the step enters."""

    def __init__(self) -> None:
        super().__init__()
        self.flags = []

    def no_sync(self, wrapped, skip_gradient_sync):
        self.flags.append(skip_gradient_sync)
        return contextlib.nullcontext()


def spying_backend() -> TrainerBackend:
    return TrainerBackend(SyncFlags(), FullPrecision())


class Sequences(ToyModule):
    """An RNN on [B, 12, 1] sequences: three chunks with ``tbptt_steps=5``."""

    def __init__(self) -> None:
        super().__init__(val_loaders=0, scheduler=None)
        x = torch.randn(32, 12, 1, generator=torch.Generator().manual_seed(0))
        self.train_ds = TensorDataset(x, x.cumsum(1))
        self.rnn = torch.nn.RNN(1, 4, batch_first=True)

    def train_step(self, global_step, batch, device, hiddens=None):
        x, y = batch
        out, hiddens = self.rnn(x, hiddens)
        return F.mse_loss(out[..., :1], y), hiddens


class LBFGSToy(ToyModule):
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)], []


class ManualLBFGSToy(LBFGSToy):
    automatic_optimization = False

    def train_step(self, global_step, batch, device):
        optimizer = self.optimizers()
        loss = super().train_step(global_step, batch, device)
        optimizer.zero_grad()
        self.manual_backward(loss)
        return loss


@pytest.mark.parametrize(
    "module, overrides, mode",
    [
        (ToyModule, {}, AutomaticStep),
        (Sequences, {"tbptt_steps": 5}, TBPTTStep),
        (LBFGSToy, {}, ClosureStep),
        (ManualLBFGSToy, {}, ManualStep),  # manual wins over the closure
    ],
    ids=["automatic", "tbptt", "closure", "manual"],
)
def test_each_configuration_runs_its_own_step_class_chosen_once(tmp_path, module, overrides, mode):
    """Catches: a mode chosen in the wrong order (the closure before manual), or a per-batch
    detour through ``TrainingStep`` (``run`` not the mode's own bound method)."""
    trainer = Trainer(module(), make_args(tmp_path, train_batch_size=16, max_steps=2, **overrides))
    trainer.train()
    step = trainer.training_step
    assert type(step.mode) is mode
    assert step.run.__self__ is step.mode and step.run.__func__ is mode.run
    assert trainer.global_steps_finished == 2


def test_every_micro_batch_and_chunk_but_a_cycles_last_skips_the_gradient_sync(tmp_path):
    """Catches: ``no_sync`` dropped (or entered on the last micro-batch) in the automatic step,
    and in the TBPTT step on non-last micro-batches or chunks; a TBPTT chunk's loss not divided
    by the cycle's length (Adam would not see it: SGD here)."""
    args = make_args(tmp_path / "automatic", train_batch_size=16, gpu_batch_size_limit=8)
    trainer = Trainer(ToyModule(n_train=64, val_loaders=0), args, trainer_backend=spying_backend())
    trainer.train()
    assert trainer.gradient_accumulation == 2 and trainer.global_steps_finished == 4
    assert trainer.backend.strategy.flags == [True, False] * 4

    args = make_args(tmp_path / "tbptt", train_batch_size=16, gpu_batch_size_limit=8, tbptt_steps=5)
    trainer = Trainer(Sequences(), args, trainer_backend=spying_backend())
    trainer.train()
    assert trainer.gradient_accumulation == 2 and trainer.global_steps_finished == 2
    assert trainer.backend.strategy.flags == [True, True, True, True, True, False] * 2  # 2 micro-batches x 3 chunks

    # Each chunk's loss is divided by the chunks and the micro-batches: the same step as one 16-sequence batch.
    whole = Trainer(Sequences(), make_args(tmp_path / "whole", train_batch_size=16, tbptt_steps=5))
    whole.train()
    assert whole.gradient_accumulation == 1
    torch.testing.assert_close(flat_parameters(trainer.module), flat_parameters(whole.module), rtol=1e-5, atol=1e-6)


class Stream(IterableDataset):
    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[index] for index in range(len(self.dataset)))


class StreamToy(ToyModule):
    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(Stream(self.train_ds), batch_size=batch_size)


def test_a_stream_ending_inside_a_cycle_steps_on_the_mean_of_the_micro_batches_it_saw(tmp_path):
    """24 samples in micro-batches of 8, two per step: step 1 averages two micro-batches, step 2
    has only the third, and its gradient is that micro-batch's (not half of it), as a
    hand-written loop computes. Every micro-batch of a stream syncs (its last is not known ahead).
    Catches: the rescale of a short cycle dropped; a stream's micro-batches run under ``no_sync``."""
    module = StreamToy(n_train=24, val_loaders=0, scheduler=None)
    reference = StreamToy(n_train=24, val_loaders=0, scheduler=None)
    args = make_args(tmp_path, train_batch_size=16, gpu_batch_size_limit=8)
    trainer = Trainer(module, args, trainer_backend=spying_backend())
    trainer.train()
    assert trainer.global_steps_finished == 2
    assert trainer.backend.strategy.flags == [False, False, False]

    (optimizer,), _ = reference.get_optimizers_schedulers(2, 1)
    x, y = reference.train_ds.tensors
    for micro_batches in ([slice(0, 8), slice(8, 16)], [slice(16, 24)]):
        for part in micro_batches:
            (F.cross_entropy(reference.net(x[part]), y[part]) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(flat_parameters(module), flat_parameters(reference), rtol=1e-6, atol=1e-7)


def test_the_closure_clips_the_gradients_the_optimizer_reevaluates(tmp_path):
    """LBFGS with ``clip_grad_value``: the framework's step equals a hand-written closure that
    clips after each backward. Catches: the closure not clipping (LBFGS would follow raw gradients)."""
    module, reference = LBFGSToy(n_train=32, val_loaders=0), LBFGSToy(n_train=32, val_loaders=0)
    Trainer(module, make_args(tmp_path, train_batch_size=32, clip_grad_value=0.01)).train()

    (optimizer,), _ = reference.get_optimizers_schedulers(1, 1)
    x, y = reference.train_ds.tensors

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(reference.net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
        return loss

    optimizer.step(closure)
    assert not torch.equal(flat_parameters(module), flat_parameters(LBFGSToy(n_train=32)))  # it did train
    torch.testing.assert_close(flat_parameters(module), flat_parameters(reference), rtol=1e-5, atol=1e-6)
