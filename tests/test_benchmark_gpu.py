"""``benchmarks/gpu.py`` where there is no GPU: ``--help``, the refusal, and its pure parts (the GPT's
FLOPs per token against torch's FLOP counter, MFU; the peak table is ``test_gpu_peaks.py``'s), plus its framework and
hand-written runs on a tiny GPT on the CPU (so the first GPU run does not fail on a typo)."""

import doctest
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu  # noqa: E402
import gpu_flops  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss, token_data  # noqa: E402
from gpu_runs import Settings, run_rows  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")


def test_help_lists_the_options():
    finished = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert finished.returncode == 0, finished.stderr
    for option in ("--size", "--backends", "--batch-size", "--steps", "--compile", "--amp-dtype", "--peak-tflops", "--json"):
        assert option in finished.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark runs instead of refusing")
def test_without_cuda_it_exits_at_once_saying_it_needs_one():
    finished = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert finished.returncode == 2 and finished.stdout == ""
    assert "benchmarks/gpu.py needs a CUDA device: torch.cuda.is_available() is False" in finished.stderr


def test_a_bad_option_is_refused_naming_it():
    with pytest.raises(SystemExit):
        gpu.parse_arguments(["--steps", "0"])


@pytest.mark.parametrize(
    "config",
    [
        GPTConfig(layers=2, width=64, heads=2, sequence=32, vocab=128),
        GPTConfig(layers=1, width=48, heads=3, sequence=20, vocab=70),
    ],
)
def test_flops_per_token_is_what_torch_counts_in_forward_and_backward(config):
    model = GPT(config)
    tokens, targets = token_data(config, 3)[:]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as matmuls torch counts
        lm_loss(model(tokens), targets).backward()
    assert counter.get_total_flops() == config.flops_per_token * tokens.numel()


def test_mfu_is_achieved_over_peak_and_the_flag_overrides_the_table():
    flops_per_token = gpu_flops.gpt_flops_per_token(layers=12, width=768, sequence=1024, vocab=50304)
    assert gpu_flops.achieved_tflops(100_000, flops_per_token) == pytest.approx(85.4654976)
    assert gpu_flops.mfu(100_000, flops_per_token, 989.4) == pytest.approx(85.4654976 / 989.4)
    assert gpu_flops.mfu(100_000, flops_per_token, None) is None
    assert gpu.peak_dtype("sp", None, tf32=True) == "tf32" and gpu.peak_dtype("sp-amp", "bfloat16", tf32=False) == "bf16"
    assert gpu_flops.peak_tflops("NVIDIA A100-SXM4-40GB", "bf16", given=250.0) == 250.0


@pytest.mark.parametrize("module", [gpu_flops, gpu])
def test_the_docstring_examples_hold(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0


def test_the_framework_and_hand_written_runs_and_the_table_work_on_a_tiny_gpt(capsys):
    settings = Settings(size="tiny", batch_size=2, steps=2, warmup=1)
    header, rows = run_rows(settings, ["sp", "sp-amp"], [False], repeats=1, device=torch.device("cpu"))
    assert [row["backend"] for row in rows] == ["sp", "sp-amp"] and header["world_size"] == 1
    for row in rows:
        assert row["framework_tokens_per_s"] > 0 and row["raw_tokens_per_s"] > 0 and row["ratio"] > 0
    gpu.add_utilisation(header, rows, amp_dtype=None, tf32=False, given_peak=1.0)
    assert rows[0]["peak_dtype"] == "fp32" and rows[0]["framework_mfu"] == pytest.approx(rows[0]["framework_tflops"])
    gpu.print_table(header, rows)
    printed = capsys.readouterr().out
    assert "GPT tiny" in printed and "sp-amp" in printed and "time ratio" in printed
