"""True bf16 precision (``backends/precision/precisions.py`` ``TrueBF16``, backends ``sp-bf16``, ``ddp-bf16``,
``fsdp-bf16``) on one process; the 2-rank runs are in ``test_memory_distributed.py``."""

import os

import pytest
import torch

from toy import ToyModule, flat_parameters, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments


class RecordingToy(ToyModule):
    """Records the dtypes of the batches and gradients it sees."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.seen = set()

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-2)], []

    def train_step(self, global_step, batch, device):
        self.seen.update(f"batch {tensor.dtype}" for tensor in batch)
        return super().train_step(global_step, batch, device)

    def on_end_backward(self, global_step, loss):
        self.seen.update(f"grad {p.grad.dtype}" for p in self.parameters())


def state_bytes(trainer: Trainer) -> int:
    """Bytes of parameters, gradients-to-be (one per parameter) and optimizer state."""
    parameters = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
    optimizer = sum(v.numel() * v.element_size() for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim())
    return 2 * parameters + optimizer


def test_sp_bf16_keeps_weights_gradients_optimizer_state_and_inputs_in_bf16(tmp_path):
    trainer = Trainer(RecordingToy(), toy_args(tmp_path / "bf16", epochs=2, backend="sp-bf16"))
    trainer.train()
    fp32 = Trainer(RecordingToy(), toy_args(tmp_path / "fp32", epochs=2))
    fp32.train()
    assert trainer.module.seen == {"batch torch.bfloat16", "batch torch.int64", "grad torch.bfloat16"}
    assert {p.dtype for p in trainer.module.parameters()} == {torch.bfloat16}
    assert {v.dtype for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim()} == {torch.bfloat16}
    assert state_bytes(trainer) * 2 == state_bytes(fp32)
    losses, fp32_losses = trainer.history.values("train_loss_epoch"), fp32.history.values("train_loss_epoch")
    assert losses[-1] < losses[0]
    assert losses[-1] == pytest.approx(fp32_losses[-1], rel=0.05)  # bf16 rounding, the same training
    assert trainer.history.latest("val_loss") == pytest.approx(fp32.history.latest("val_loss"), rel=0.05)


def test_sp_bf16_checkpoints_hold_bf16_and_resume_exactly(tmp_path):
    def run(directory, **overrides):
        checkpoints = DefaultCheckpointerArguments(save_dir=str(directory / "checkpoints"), resume="auto", save_every_n_steps=3)
        trainer = Trainer(ToyModule(dropout=0.2), toy_args(directory, checkpoints, epochs=2, backend="sp-bf16", **overrides))
        trainer.train()
        return trainer

    uninterrupted = run(tmp_path / "whole")
    run(tmp_path / "stopped", max_steps=5)
    resumed = run(tmp_path / "stopped")
    assert torch.equal(flat_parameters(resumed.module), flat_parameters(uninterrupted.module))
    newest = sorted(os.listdir(tmp_path / "stopped" / "checkpoints"))[-1]
    state = torch.load(tmp_path / "stopped" / "checkpoints" / newest, weights_only=True)
    assert {tensor.dtype for tensor in state["module"]["model"].values()} == {torch.bfloat16}


def test_amp_dtype_float16_is_refused_for_true_bf16(tmp_path):
    with pytest.raises(ValueError, match=r"amp_dtype='float16' does not apply to true bf16 precision; allowed: None, 'bfloat16'"):
        Trainer(ToyModule(), toy_args(tmp_path, backend="sp-bf16", amp_dtype="float16"))
