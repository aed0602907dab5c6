"""A pipeline run (fsdp, pp 2, 2 gloo ranks under ``torchrun --max-restarts=1``) whose last stage is
SIGKILLed mid-run resumes from its per-stage checkpoint to the same weights, bitwise, and the same
logged losses as a run never interrupted (``tests/pipeline_resume_script.py``).

Faults caught: a stage resuming another stage's optimizer state or weights (``stage_group`` /
``one_stage`` ignored), the loader's position or RNG not restored on either stage.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(out: str, *arguments: str) -> str:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    command += ["--monitor-interval=0.1", os.path.join(HERE, "pipeline_resume_script.py"), out, *arguments]
    process = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    return process.stdout + process.stderr


def test_a_killed_pipeline_resumes_bitwise(tmp_path):
    torchrun(str(tmp_path / "whole"))
    output = torchrun(str(tmp_path / "killed"), "--kill", "2@1")
    assert "KILLING at step 2 on rank 1" in output
    assert "loaded checkpoint" in output and "(epoch 0, step 2)" in output  # resumed, not started again
    for rank in (0, 1):
        whole = torch.load(tmp_path / "whole" / f"result-{rank}.pt", weights_only=True)
        resumed = torch.load(tmp_path / "killed" / f"result-{rank}.pt", weights_only=True)
        assert resumed["step"] == whole["step"] == 5
        assert set(resumed["weights"]) == set(whole["weights"])
        assert all(torch.equal(resumed["weights"][name], tensor) for name, tensor in whole["weights"].items())
        logged = [(r["name"], r["step"], r["value"]) for r in whole["history"] if r["name"] == "train_loss"]
        assert [(r["name"], r["step"], r["value"]) for r in resumed["history"] if r["name"] == "train_loss"] == logged
