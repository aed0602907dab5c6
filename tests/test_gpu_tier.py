"""The ``cuda`` tier (``tests/cuda/``) where there is no GPU: it collects quickly, every test in it is
marked ``cuda``, and each is skipped with a reason naming CUDA (none fails, none passes by skipping
its checks). The tier itself runs on a GPU machine: CONTRIBUTING.md, "On a GPU machine"."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the tier runs for real (pytest -m cuda)")
def test_without_a_gpu_every_test_of_the_tier_is_marked_cuda_and_skipped_naming_cuda():
    command = [sys.executable, "-m", "pytest", "tests/cuda", "-m", "cuda", "-rs", "-q", "-p", "no:cacheprovider"]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=300)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    assert re.fullmatch(r"(\d+) skipped in [\d.]+s", summary), summary  # nothing deselected (unmarked), failed or passed
    skipped = int(summary.split()[0])
    reasons = re.findall(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", output, re.MULTILINE)
    assert sum(int(count) for count, _, _ in reasons) == skipped >= 19
    assert all("CUDA" in reason for _, _, reason in reasons), reasons
    tier_files = {location.split(":")[0] for _, location, _ in reasons}
    expected = {f"tests/cuda/{name}" for name in os.listdir(os.path.join(ROOT, "tests", "cuda")) if name.startswith("test_")}
    assert tier_files == expected
