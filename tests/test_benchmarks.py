"""The benchmark scripts' helpers (the benchmarks themselves are run by hand: docs/benchmarks.md)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from fresh_process import fit_line, json_objects  # noqa: E402
from scaling import stack_width  # noqa: E402


def test_fit_line_recovers_slope_and_intercept():
    slope, intercept = fit_line([256, 512, 1024], [1.0 + 0.002 * 256, 1.0 + 0.002 * 512, 1.0 + 0.002 * 1024])
    assert slope == pytest.approx(0.002) and intercept == pytest.approx(1.0)


def test_json_objects_reads_ranks_sharing_one_line():
    output = 'log line\n{"rank": 1, "train_seconds": 0.5}{"rank": 0, "train_seconds": 0.25}\n\n'
    assert json_objects(output) == [{"rank": 1, "train_seconds": 0.5}, {"rank": 0, "train_seconds": 0.25}]


@pytest.mark.parametrize("parameters", [1e5, 1e6, 1e7, 5e7])
def test_checkpoint_stack_is_sized_to_the_parameter_count(parameters):
    width = stack_width(parameters)
    assert 4 * (width * width + width) == pytest.approx(parameters, rel=0.01)


@pytest.mark.parametrize("script", ["scaling.py", "ddp_overhead.py", "fresh_process.py", "vae.py", "profile_setup.py"])
def test_help_runs(script):
    finished = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert finished.returncode == 0, finished.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_child_times_the_stall_and_the_write(mode):
    """scaling.py's checkpoint child drives the real checkpointer (its timing hooks follow the framework's API)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--child-checkpoint", mode]
    command += ["--parameters", "1e4", "--saves", "2", "--device", "cpu"]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=300)
    assert finished.returncode == 0, finished.stderr
    result = json_objects(finished.stdout)[-1]
    assert len(result["stall"]) == 2 and len(result["write"]) == 2 and result["bytes"] > 0


@pytest.mark.parametrize("runner", ["raw", "quiet"])
def test_fresh_child_reports_its_training_call_and_its_steady_part(runner):
    """fresh_process.py's child: the steady part (second epoch's start to the end) is inside the training call."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "fresh_process.py"), "--child", runner, "--epochs", "2"]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=300)
    assert finished.returncode == 0, finished.stderr
    result = json_objects(finished.stdout)[-1]
    assert 0 < result["steady_seconds"] < result["train_seconds"]
