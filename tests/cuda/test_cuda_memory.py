"""Device memory on a GPU: asynchronous checkpoints staged out of GPU memory (resumed bitwise), the
``gpu_batch_size_limit="auto"`` search against a real out-of-memory, and activation checkpointing's
saving measured with ``torch.cuda.max_memory_allocated``. The CPU counterparts are
``test_checkpoint.py``, ``test_auto_micro_batch.py`` (a simulated OOM) and
``test_activation_checkpointing.py`` (bytes kept for backward)."""

import gc
import glob
import json
import os

import pytest
import torch
from logs import captured_log

from cuda_support import CUDA_TIER, cuda_args
from tiny_transformer import TinyTransformer
from toy import ToyModule, flat_parameters

from backends.strategies.activation_checkpointing import checkpoint_units
from framework import Trainer
from framework.callbacks.throughput import known_peak_flops
from framework.checkpoint import DefaultCheckpointerArguments
from framework.checkpoint.staging import StagingBuffers

pytestmark = CUDA_TIER


def test_staging_copies_gpu_state_into_reused_pinned_cpu_buffers():
    weights = torch.randn(1024, 1024, device="cuda")
    original = weights.cpu()
    state = {"model": {"w": weights, "tied": weights}, "steps": [torch.tensor(3, device="cuda")], "name": "run"}
    staging = StagingBuffers()
    first = staging.copy(state)
    weights.add_(1)  # training goes on: the staged copy must not change
    assert first["model"]["w"].device.type == "cpu" and first["model"]["w"].is_pinned()
    assert first["model"]["tied"] is first["model"]["w"] and first["name"] == "run"
    assert torch.equal(first["model"]["w"], original) and first["steps"][0].item() == 3
    second = staging.copy(state)  # the next save reuses the pinned buffers
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], weights.cpu())


def test_async_checkpoints_of_a_gpu_run_hold_cpu_tensors_and_resume_bitwise(tmp_path):
    def run(directory, async_save, **overrides):
        checkpoints = DefaultCheckpointerArguments(
            save_dir=str(directory / "checkpoints"), resume="auto", save_every_n_steps=1, async_save=async_save
        )
        trainer = Trainer(ToyModule(dropout=0.2), cuda_args(directory, checkpoints, epochs=2, **overrides))
        trainer.train()
        return trainer

    uninterrupted = run(tmp_path / "whole", async_save=False)
    run(tmp_path / "stopped", async_save=True, max_steps=5)
    newest = sorted(name for name in os.listdir(tmp_path / "stopped" / "checkpoints") if name.startswith("checkpoint-"))[-1]
    state = torch.load(tmp_path / "stopped" / "checkpoints" / newest, weights_only=True)  # tensors where they were saved
    assert {tensor.device.type for tensor in state["module"]["model"].values()} == {"cpu"}
    resumed = run(tmp_path / "stopped", async_save=True)
    assert resumed.global_steps_finished == 16
    assert torch.equal(flat_parameters(resumed.module), flat_parameters(uninterrupted.module))


WIDE = 1 << 18  # a hidden layer of 1 MiB of fp32 activations per sample
MEMORY_CAP = 1 << 30


def wide_module() -> ToyModule:
    """About 70 MB of weights, gradients and momentum, and 2-4 MB of activations per sample: 4096
    samples need about 16 GB, far beyond the 1 GiB cap; a few hundred fit."""
    return ToyModule(n_train=4096, hidden=WIDE, scheduler=None, val_loaders=0)


def test_auto_micro_batch_backs_off_from_a_real_out_of_memory_and_trains_as_the_limit_by_hand(tmp_path):
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(MEMORY_CAP / torch.cuda.get_device_properties(device).total_memory, device)
    try:
        torch.cuda.reset_peak_memory_stats(device)
        common = dict(epochs=1, train_batch_size=4096, log_level="INFO")
        auto = Trainer(wide_module(), cuda_args(tmp_path / "auto", gpu_batch_size_limit="auto", **common))
        with captured_log() as messages:
            auto.train()
        found = auto.train_step_batch_size
        assert 1 <= found < 4096 and auto.gradient_accumulation == 4096 // found
        assert "gpu_batch_size_limit='auto': a micro-batch of 4096 does not fit" in messages  # a real CUDA OOM
        assert f"gpu_batch_size_limit='auto': a micro-batch of {found * 2} does not fit" in messages
        assert torch.cuda.max_memory_allocated(device) <= MEMORY_CAP
        auto_weights = flat_parameters(auto.module)
        del auto  # its weights, gradients and momentum leave the capped memory before the next run
        gc.collect()
        torch.cuda.empty_cache()
        by_hand = Trainer(wide_module(), cuda_args(tmp_path / "hand", gpu_batch_size_limit=found, **common))
        by_hand.train()
        torch.testing.assert_close(auto_weights, flat_parameters(by_hand.module), rtol=0, atol=1e-6)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def peak_step_bytes(module: torch.nn.Module, tokens: torch.Tensor) -> tuple:
    """(peak bytes above the weights during one forward and backward, the gradients)."""
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module(tokens).float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, {name: p.grad.detach().clone() for name, p in module.named_parameters()}


def test_activation_checkpointing_lowers_peak_gpu_memory_with_the_same_gradients():
    plain = TinyTransformer(width=256, depth=4).cuda()
    checkpointed = TinyTransformer(width=256, depth=4).cuda()
    checkpoint_units(checkpointed)
    tokens = torch.randint(0, 32, (8, 512), device="cuda")
    for module in (plain, checkpointed):
        peak_step_bytes(module, tokens)  # warm-up: cuBLAS workspaces and kernels are allocated once
    plain_peak, plain_grads = peak_step_bytes(plain, tokens)
    kept_peak, grads = peak_step_bytes(checkpointed, tokens)
    assert kept_peak < 0.6 * plain_peak, (kept_peak, plain_peak)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["sp", "sp-amp"])
def test_training_with_activation_checkpointing_on_gpu_ends_with_the_same_weights(tmp_path, backend):
    weights = {}
    amp_dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if backend == "sp-amp" else None
    for on in (False, True):
        args = cuda_args(
            tmp_path / str(on), train_batch_size=16, backend=backend, amp_dtype=amp_dtype, activation_checkpointing=on
        )
        trainer = Trainer(TinyTransformer(), args)
        trainer.train()
        weights[on] = flat_parameters(trainer.module)
    assert (weights[True] - weights[False]).abs().max().item() <= (1e-5 if backend == "sp" else 1e-3)


class CountedFlops(ToyModule):
    @property
    def flops_per_sample(self) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def test_profilers_on_gpu_report_peak_memory_mfu_against_the_known_peak_and_cuda_kernels(tmp_path):
    """``profiler="torch"`` (with ``Throughput``) on a GPU: the CPU test's figures plus what only CUDA has."""
    args = cuda_args(tmp_path, profiler="torch", train_batch_size=32, log_every_n_steps=2)  # 8 steps
    module = CountedFlops()
    trainer = Trainer(module, args)
    trainer.train()
    history = trainer.history
    peaks, samples = history.values("peak_memory_gib"), history.values("samples_per_second")
    assert len(peaks) == len(samples) == 4
    assert all(0 < peak <= torch.cuda.max_memory_allocated() / 2**30 for peak in peaks)
    peak_flops = known_peak_flops(trainer.device)
    if peak_flops is None:  # a GPU the table does not know: no MFU unless Throughput(peak_flops=...) is given
        assert history.values("mfu") == []
    else:
        expected = [rate * module.flops_per_sample / peak_flops for rate in samples]
        assert history.values("mfu") == pytest.approx(expected, rel=1e-6)
    traces = glob.glob(os.path.join(args.output_dir, "profiler", "rank0*.pt.trace.json"))
    assert len(traces) == 1
    with open(traces[0]) as handle:
        events = json.load(handle)["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)  # the GPU's own kernels, not only CPU operators
