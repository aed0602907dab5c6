"""``benchmarks/pipeline.py``, ``pipeline_runs.py`` and ``gpu_pipeline.py`` (the GPU tier's pipeline rows) on
the CPU: what they measure is what a pipeline holds and does, on 2 real gloo ranks with a small model
(the benchmarks themselves are run by hand: docs/benchmarks.md)."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pipeline  # noqa: E402
from pipeline_runs import ActivationMeter, Workload, framework_run, hand_written_run, hand_written_stage  # noqa: E402

SMALL = dict(vocab_size=32, dim=16, n_layers=4, n_heads=2, hidden_dim=32, seq_len=8)


def test_the_meter_counts_the_activations_autograd_holds_until_backward_frees_them():
    """Faults: parameters counted as activations (mutant: the parameter check removed from ``pack``: the
    weight's 4 KiB join the peak); bytes never released (mutant: ``release`` a no-op: ``live`` stays up)."""
    layer = torch.nn.Linear(32, 32)
    with ActivationMeter(layer.parameters(), torch.device("cpu")) as meter:
        hidden = layer(torch.ones(8, 32, requires_grad=True))  # keeps the input: 8 x 32 floats
        loss = (hidden.tanh() * hidden).sum()  # keeps hidden and tanh's output (a storage counted once per holder)
    assert meter.peak == 3 * 8 * 32 * 4 and meter.live == meter.peak
    loss.backward()
    assert meter.live == 0


def small_workload(steps: int = 1) -> Workload:
    sys.path[:0] = [os.path.join(ROOT, "examples")]
    import pipeline_parallel as example

    config = example.LlamaArguments(**SMALL, samples=8)

    def model():
        torch.manual_seed(0)
        return example.PipelineLlama(config)

    tokens = example.rule_sequences(8 * (steps + 1), SMALL["seq_len"] + 1, SMALL["vocab_size"])
    module = model()
    batches = [module.pipeline_inputs((tokens[i * 8 : (i + 1) * 8],)) for i in range(steps + 1)]
    return Workload(model=model, blocks="layers", loss=module.pipeline_loss, batches=batches, warmup=1)


def two_stage_runs(rank: int):
    from backends.strategies.pipeline_stages import default_stages, keep_stage

    dist.init_process_group("gloo")
    work, cpu, group = small_workload(), torch.device("cpu"), dist.group.WORLD
    results = {}
    for schedule in ("GPipe", "1F1B"):
        results[schedule] = {
            "framework": framework_run(work, schedule, 4, cpu, group),
            "raw": hand_written_run(work, schedule, 4, cpu, group),
        }
    results["Interleaved1F1B"] = hand_written_run(work, "Interleaved1F1B", 4, cpu, group)
    framework_stage = work.model()
    keep_stage(framework_stage, default_stages(framework_stage, 2)[rank])
    results["names"] = {
        "framework": [name for name, _ in framework_stage.named_parameters()],
        "raw": [name for name, _ in hand_written_stage(work.model(), "layers", rank, 2).named_parameters()],
    }
    import gpu
    from gpu_pipeline import pipeline_rows
    from gpu_runs import Settings

    rows = pipeline_rows(Settings(size="tiny", batch_size=2, steps=1, warmup=1), 1, cpu)
    header = {"device": "cpu", "world_size": 2, "flops_per_token": Settings(size="tiny").config.flops_per_token}
    gpu.add_utilisation(header, rows, amp_dtype=None, tf32=False, given_peak=1.0)
    results["gpu_rows"] = rows
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(two_stage_runs, timeout=120)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_hand_written_cut_is_the_frameworks(runs):
    """Fault: the hand-written loop timing another split than the framework's (mutant: ``hand_written_stage``
    leaving the head on every stage, or its bounds off by one block): the ratio would compare different work."""
    for rank in runs:
        assert rank["names"]["raw"] == rank["names"]["framework"]
    assert runs[0]["names"]["raw"][0] == "tok_embeddings.weight" and runs[1]["names"]["raw"][-1] == "output.weight"


@pytest.mark.distributed
@pytest.mark.slow
def test_1f1b_holds_fewer_micro_batches_than_gpipe_and_both_paths_hold_the_same(runs):
    """Faults: the memory column not measuring what a schedule holds (mutant: ``pack`` counting every
    tensor once per step and never releasing: GPipe and 1F1B would be equal); the framework's path holding
    other activations than torch's own (mutant: ``PipelineRunner`` built with ``GPipe`` whatever is asked).
    GPipe keeps all 4 micro-batches on every stage; 1F1B keeps 2 on the first of 2 stages, 1 on the last."""
    gpipe, one_f_one_b = (runs[0][name]["raw"]["activations_per_rank"] for name in ("GPipe", "1F1B"))
    assert 0.4 < one_f_one_b[0] / gpipe[0] < 0.6
    assert 0.15 < one_f_one_b[1] / gpipe[1] < 0.35
    for schedule in ("GPipe", "1F1B"):
        framework, raw = (runs[0][schedule][side]["activations_per_rank"] for side in ("framework", "raw"))
        assert framework == pytest.approx(raw, rel=0.02)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_run_reports_a_step_time_and_a_bubble_between_0_and_1(runs):
    """Fault: the compute clock not wrapping the stages (mutant: ``StageClock`` wrapping nothing: compute 0,
    bubble 1) or counting the waits too (bubble 0 or below)."""
    results = runs[0]
    for run in [results[s][side] for s in ("GPipe", "1F1B") for side in ("framework", "raw")] + [results["Interleaved1F1B"]]:
        assert run["step"] > 0
        assert all(0.0 < bubble < 1.0 for bubble in run["bubble_per_rank"])
        assert all(compute > 0 for compute in run["compute_per_rank"])
    assert len(results["Interleaved1F1B"]["activations_per_rank"]) == 2  # 2 ranks, each holding 2 of the 4 stages


@pytest.mark.distributed
@pytest.mark.slow
def test_the_gpu_tier_pipeline_rows_run_on_cpu_ranks(runs):
    """Fault: the GPU tier's pipeline case failing on its first GPU run (a typo, a row gpu.py cannot print)."""
    rows = runs[0]["gpu_rows"]
    assert [row["backend"] for row in rows] == ["pp-GPipe", "pp-1F1B"]
    for row in rows:
        assert row["framework_tokens_per_s"] > 0 and row["raw_tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["micro_batches"] == 4 and row["peak_dtype"] == "fp32"


def test_the_trainer_flag_names_the_missing_contract():
    """Fault: ``--trainer`` on a framework without issue 52's fields failing deep inside a rank (or timing
    something else): it is refused before any process starts, naming the fields."""

    @dataclasses.dataclass
    class Before:
        epochs: int = 1

    @dataclasses.dataclass
    class After(Before):
        pipeline_parallel_size: int = 1
        pipeline_schedule: str = "1F1B"

    assert pipeline.trainer_contract_missing(Before) == ["pipeline_parallel_size", "pipeline_schedule"]
    assert pipeline.trainer_contract_missing(After) == []
    with pytest.raises(SystemExit, match=r"TrainerArguments has no \['pipeline_parallel_size', 'pipeline_schedule'\]"):
        pipeline.check_trainer_contract(Before)
    pipeline.check_trainer_contract(After)


def test_help_runs_and_bad_options_are_refused_naming_them():
    script = os.path.join(ROOT, "benchmarks", "pipeline.py")
    finished = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert finished.returncode == 0 and "--trainer" in finished.stdout and "--schedules" in finished.stdout
    finished = subprocess.run(
        [sys.executable, script, "--micro-batch-counts", "3"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert finished.returncode == 2 and "--micro-batch-counts 3 is invalid; allowed: divisors of the batch, 16" in finished.stderr
    with pytest.raises(SystemExit):
        pipeline.parse(["--schedules", "Zigzag"])


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_flag_times_the_trainers_pipeline_against_the_hand_written_loop():
    """Fault: ``--trainer`` written against names the Trainer does not take (refused, naming them)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "pipeline.py"), "--trainer", "--nproc", "2"]
    command += ["--steps", "1", "--rounds", "1", "--schedules", "1F1B", "--micro-batch-counts", "4"]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=900)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert "framework (Trainer (fsdp + pipeline)) ms" in finished.stdout


def test_gpu_py_runs_the_pipeline_rows_unless_told_not_to():
    """Fault: the GPU tier's pipeline case unreachable from the one GPU command (mutant: ``--pipeline``
    defaulting to ``off``)."""
    import gpu

    assert gpu.parse_arguments([]).pipeline == "on" and gpu.parse_arguments(["--pipeline", "off"]).pipeline == "off"
