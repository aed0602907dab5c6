"""An RL run resumes bitwise on 2 ``ddp`` ranks after the whole job is SIGKILLed, twice.

``tests/dqn_script.py`` is a small DQN: each rank plays its own seeded environment into its own
replay buffer (numpy arrays, a numpy ``Generator``, a ``random.Random`` in ``get_state()``) and
trains on a per-rank stream sampled from it. Under torchrun, the whole job (torchrun and both
workers) is SIGKILLed once in the middle of an epoch (one step past the last step checkpoint)
and once right after an epoch-end checkpoint was written; rerunning the same command resumes
each time. The weights and each rank's environment, buffer and RNG states must equal an
uninterrupted run's bit for bit, on both ranks.
"""

import os
import signal
import subprocess
import sys
from typing import Any, Dict

import numpy as np
import pytest
import torch

import framework.checkpoint.safe_types  # noqa: F401 - lets weights_only loading read numpy and random states

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dqn_script.py")
# After step 13 (the last checkpoint is step 12's), and right after epoch 3's end (step 24).
KILLS = ("--kill", "mb:1:5", "--kill", "begin:3")


def torchrun(out: os.PathLike, *arguments: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1"]
    # Its own session, so the script's SIGKILL of torchrun's process group never reaches pytest.
    return subprocess.run(
        [*command, SCRIPT, str(out), *arguments], capture_output=True, text=True, timeout=240, env=env, start_new_session=True
    )


def rank_results(out: os.PathLike) -> Dict[int, Dict[str, Any]]:
    return {rank: torch.load(os.path.join(out, f"result-rank{rank}.pt"), weights_only=True) for rank in range(2)}


def assert_identical(got: Any, want: Any, where: str) -> None:
    """Bitwise equality through dicts, lists, arrays, tensors and numpy/Python RNGs."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: max |diff| {(got.double() - want.double()).abs().max().item()}"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, np.random.Generator):
        assert got.bit_generator.state == want.bit_generator.state, where
    elif hasattr(want, "getstate"):  # random.Random
        assert got.getstate() == want.getstate(), where
    else:
        assert got == want, where


def test_dqn_with_per_rank_envs_and_buffers_resumes_bitwise_after_the_whole_job_is_killed_twice(tmp_path):
    reference_dir, killed_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    process = torchrun(reference_dir)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    reference = rank_results(reference_dir)

    outputs = []
    for expected in (-signal.SIGKILL, -signal.SIGKILL, 0):  # mid-epoch kill, epoch-end kill, then to the end
        process = torchrun(killed_dir, *KILLS)
        outputs.append(process.stdout + process.stderr)
        assert process.returncode == expected, outputs[-1][-6000:]
    assert "KILLING the whole job at mb:1:5 (step 13)" in outputs[0]
    assert "checkpoint-000000012.pt (epoch 1, step 12)" in outputs[1]  # step 13 is trained again
    assert "KILLING the whole job at begin:3 (step 24)" in outputs[1]
    assert "checkpoint-000000024.pt (epoch 3, step 24)" in outputs[2]  # the epoch-end checkpoint
    assert sorted(os.listdir(killed_dir / "kills")) == ["begin_3", "mb_1_5"]
    resumed = rank_results(killed_dir)

    # The ranks really differ: each played its own environment into its own buffer.
    assert not np.array_equal(
        reference[0]["state"]["buffer"]["arrays"]["observation"], reference[1]["state"]["buffer"]["arrays"]["observation"]
    )
    for rank in range(2):
        assert resumed[rank]["step"] == reference[rank]["step"] == 32
        assert_identical(resumed[rank], reference[rank], f"rank {rank}")
