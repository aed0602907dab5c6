"""Precisions on a GPU: ``sp-amp`` fp16 with a real GradScaler against the hand-written torch loop
(the inf step skipped as torch skips it, the scaler state resumed bitwise), ``sp-amp`` bf16 and
``sp-bf16`` against fp32 on the same GPU. The CPU counterparts are ``test_amp.py`` and
``test_true_bf16.py``."""

import os

import pytest
import torch
import torch.nn.functional as F

from cuda_support import CUDA_TIER, cuda_args
from toy import ToyModule, flat_parameters

from framework import Trainer
from framework.callbacks import Callback
from framework.checkpoint import DefaultCheckpointerArguments

pytestmark = CUDA_TIER

INF_STEP = 2


class InfAtStep(ToyModule):
    """Its loss is infinite at one step (a real fp16 overflow's effect); it keeps the batches it saw."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batches = []

    def train_step(self, global_step, batch, device):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        logits = self.net(x)
        self.dtype_seen = logits.dtype
        loss = F.cross_entropy(logits, y)
        return loss * float("inf") if global_step == INF_STEP else loss


class StepRecorder(Callback):
    """After every optimizer step: parameters, scheduler position and the scaler's scale."""

    def __init__(self) -> None:
        self.steps = []

    def on_end_optimizer_step(self, global_step):
        scaler = self.trainer.backend.precision.scaler
        self.steps.append(
            {
                "params": flat_parameters(self.trainer.module),
                "scheduler_position": self.trainer.schedulers[0].last_epoch,
                "scale": scaler.get_scale() if scaler is not None else None,
            }
        )


def hand_written_fp16_loop(batches, total_steps: int) -> list:
    """The loop torch's AMP recipe gives: autocast fp16, GradScaler, the scheduler held on a skipped step."""
    net = ToyModule().net.cuda()  # ToyModule(seed=0): the same initial weights
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps)
    scaler = torch.amp.GradScaler("cuda")
    steps = []
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
            loss = loss * float("inf") if step == INF_STEP else loss
        scaler.scale(loss).backward()
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale_before:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"params": flat_parameters(net), "scheduler_position": scheduler.last_epoch, "scale": scaler.get_scale()})
    return steps


def test_sp_amp_on_cuda_is_fp16_with_a_grad_scaler_and_skips_the_inf_step_as_torch_does(tmp_path):
    module, recorder = InfAtStep(), StepRecorder()
    trainer = Trainer(module, cuda_args(tmp_path, train_batch_size=32, backend="sp-amp"), callbacks=[recorder])
    trainer.train()
    precision = trainer.backend.precision
    assert trainer.device.type == "cuda" and precision.dtype == torch.float16 and precision.scaler is not None
    assert module.dtype_seen == torch.float16  # autocast runs the forward in fp16
    assert len(recorder.steps) == trainer.global_steps_finished == 8
    skipped, before = recorder.steps[INF_STEP], recorder.steps[INF_STEP - 1]
    assert torch.equal(skipped["params"], before["params"])  # the inf step changed nothing
    assert skipped["scheduler_position"] == before["scheduler_position"]
    assert skipped["scale"] == before["scale"] / 2  # and halved the scale
    reference = hand_written_fp16_loop(module.batches, total_steps=8)
    assert [s["scale"] for s in recorder.steps] == [s["scale"] for s in reference]
    assert [s["scheduler_position"] for s in recorder.steps] == [s["scheduler_position"] for s in reference]
    for ours, theirs in zip(recorder.steps, reference):
        torch.testing.assert_close(ours["params"], theirs["params"], rtol=1e-5, atol=1e-6)


def test_fp16_scaler_state_is_saved_and_resumed_bitwise(tmp_path):
    def run(directory, **overrides):
        checkpoints = DefaultCheckpointerArguments(save_dir=str(directory / "checkpoints"), resume="auto", save_every_n_steps=3)
        module = InfAtStep(dropout=0.2, scheduler="step")  # dropout: the CUDA generator must resume too
        trainer = Trainer(module, cuda_args(directory, checkpoints, epochs=2, train_batch_size=32, backend="sp-amp", **overrides))
        trainer.train()
        return trainer

    uninterrupted = run(tmp_path / "whole")
    stopped = run(tmp_path / "stopped", max_steps=5)
    saved_scaler = stopped.backend.state_dict()["precision"]["scaler"]
    assert saved_scaler["scale"] <= 32768.0  # the inf step halved the initial 65536: the state is not the default
    newest = sorted(name for name in os.listdir(tmp_path / "stopped" / "checkpoints") if name.startswith("checkpoint-"))[-1]
    in_file = torch.load(tmp_path / "stopped" / "checkpoints" / newest, weights_only=True)
    assert in_file["backend"]["precision"]["scaler"] == saved_scaler
    resumed = run(tmp_path / "stopped")
    assert resumed.global_steps_finished == uninterrupted.global_steps_finished == 16
    assert torch.equal(flat_parameters(resumed.module), flat_parameters(uninterrupted.module))
    assert resumed.backend.state_dict() == uninterrupted.backend.state_dict()


class DtypeToy(ToyModule):
    """Notes the dtype its network computes in."""

    def train_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.dtypes = (x.dtype, logits.dtype)
        return F.cross_entropy(logits.float(), y)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-2)], []


@pytest.mark.parametrize(
    "backend, amp_dtype, input_dtype, compute_dtype, weight_dtype",
    [
        ("sp-amp", "bfloat16", torch.float32, torch.bfloat16, torch.float32),
        ("sp-bf16", None, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_bf16_backends_on_cuda_train_as_fp32_does(tmp_path, backend, amp_dtype, input_dtype, compute_dtype, weight_dtype):
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bfloat16 support (needs compute capability 8.0+)")
    fp32 = Trainer(DtypeToy(), cuda_args(tmp_path / "fp32", epochs=3))
    fp32.train()
    module = DtypeToy()
    trainer = Trainer(module, cuda_args(tmp_path / backend, epochs=3, backend=backend, amp_dtype=amp_dtype))
    trainer.train()
    assert module.dtypes == (input_dtype, compute_dtype)
    assert {p.dtype for p in trainer.module.parameters()} == {weight_dtype}
    assert getattr(trainer.backend.precision, "scaler", None) is None  # bf16 needs no loss scaling
    losses, fp32_losses = trainer.history.values("train_loss_epoch"), fp32.history.values("train_loss_epoch")
    assert losses[-1] < losses[0]
    assert losses[-1] == pytest.approx(fp32_losses[-1], rel=0.05)  # bf16 rounding, the same training
    assert trainer.history.latest("val_loss") == pytest.approx(fp32.history.latest("val_loss"), rel=0.05)
