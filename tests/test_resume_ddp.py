"""Exact resume under DDP (2 gloo ranks): ``torchrun --max-restarts=2`` recovers from killed workers.

``tests/resume_script.py`` runs under torchrun with ``backend="ddp"``, ``resume="auto"`` and
asynchronous saves. Two workers are SIGKILLed during the run: rank 1 in the middle of an
accumulation cycle, then rank 0 (the writer) right after it handed an epoch-end checkpoint
to its background writer. torchrun restarts every worker with the same command each time;
the run must end with the weights and metrics of an uninterrupted run (within 1e-6).

torchrun runs with its default shared rendezvous store: the DDP strategy namespaces its
process-group keys by restart attempt, so restarted gloo workers never read a dead worker's
address (pytorch/pytorch#135712).
"""

import os
import subprocess
import sys
from typing import Any, Dict

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")


def torchrun(out: os.PathLike, *arguments: str, max_restarts: int = 0, expect_returncode: int = 0) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        SCRIPT,
        str(out),
        "--backend",
        "ddp",
        "--async-save",
        *arguments,
    ]
    process = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert process.returncode == expect_returncode, (
        f"torchrun ended with {process.returncode} ({process.returncode}):\n{process.stdout[-4000:]}\n{process.stderr[-6000:]}"
    )
    return process


def result(out: os.PathLike) -> Dict[str, Any]:
    return torch.load(os.path.join(out, "result.pt"), weights_only=True)


def test_torchrun_max_restarts_recovers_killed_workers(tmp_path):
    reference_dir, killed_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    torchrun(reference_dir)
    reference = result(reference_dir)

    process = torchrun(killed_dir, "--kill", "mb:1:6@1", "--kill", "begin:2@0", max_restarts=2)
    output = process.stdout + process.stderr
    assert "KILLING at mb:1:6" in output and "KILLING at begin:2" in output
    assert sorted(os.listdir(killed_dir / "kills")) == ["begin_2", "mb_1_6"]
    assert output.count("loaded checkpoint") == 2  # rank zero logs each of the two resumes
    resumed = result(killed_dir)

    assert resumed["step"] == reference["step"]
    difference = (resumed["params"] - reference["params"]).abs().max().item()
    assert difference <= 1e-6, f"max |param diff| = {difference}"
    assert [(r["epoch"], r["step"], r["name"]) for r in resumed["history"]] == [
        (r["epoch"], r["step"], r["name"]) for r in reference["history"]
    ]
    for got, want in zip(resumed["history"], reference["history"]):
        assert abs(got["value"] - want["value"]) <= 1e-6 * max(1.0, abs(want["value"])), (got, want)


def test_ranks_signalled_at_different_steps_agree_on_one_stop_step_and_resume(tmp_path):
    # Rank 0 gets SIGTERM during step 11, rank 1 only during step 13 (2 micro-batches per step):
    # both must save the same step (one past the later one, 14) and exit 75; rerunning the
    # same command resumes and ends where an uninterrupted run ends.
    reference_dir, preempted_dir = tmp_path / "uninterrupted", tmp_path / "preempted"
    torchrun(reference_dir)
    reference = result(reference_dir)

    signals = ("--send-signal", "mb:1:5=SIGTERM@0", "--send-signal", "mb:1:9=SIGTERM@1")
    process = torchrun(preempted_dir, *signals, expect_returncode=1)
    output = process.stdout + process.stderr
    assert "SIGNALLING SIGTERM at mb:1:5 (step 10)" in output and "SIGNALLING SIGTERM at mb:1:9 (step 12)" in output
    assert "saving a checkpoint at step 14" in output and "exitcode  : 75" in output, output[-3000:]
    assert "STEP 14" in output and "STEP 15" not in output
    saved = sorted(name for name in os.listdir(preempted_dir / "checkpoints") if name.endswith(".pt"))
    assert saved[-1] == "checkpoint-000000014.pt"

    process = torchrun(preempted_dir, *signals)
    assert "loaded checkpoint" in process.stdout + process.stderr
    resumed = result(preempted_dir)
    assert resumed["step"] == reference["step"]
    difference = (resumed["params"] - reference["params"]).abs().max().item()
    assert difference <= 1e-6, f"max |param diff| = {difference}"
