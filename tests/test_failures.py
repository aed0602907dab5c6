"""A rank that fails under ``ddp``: every rank exits, quickly, and the original error is shown."""

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from distributed import free_port, run_ranks
from toy import ToyModule

from framework import Trainer, TrainerArguments

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAIL_STEP = 3


class FailingToy(ToyModule):
    """Rank 1 raises (or stalls) in the middle of the first epoch."""

    def __init__(self, mode: str = "raise", stall_seconds: float = 0.0) -> None:
        super().__init__(n_train=256, n_val=32)
        self.mode, self.stall_seconds = mode, stall_seconds
        self.woke_at = None

    def train_step(self, global_step, batch, device):
        if int(os.environ.get("RANK", 0)) == 1 and global_step == FAIL_STEP:
            if self.mode == "raise":
                raise RuntimeError(f"boom: rank 1 failed at step {global_step}")
            time.sleep(self.stall_seconds)
            self.mode, self.woke_at = "done", time.time()
        return super().train_step(global_step, batch, device)


def _args(output_dir: str, **overrides) -> TrainerArguments:
    values = dict(epochs=2, train_batch_size=16, backend="ddp", disable_tqdm=True, log_every_n_steps=1, output_dir=output_dir)
    values.update(overrides)
    return TrainerArguments(**values)


FAILING_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_failures import FailingToy, _args
from framework import Trainer
Trainer(FailingToy(), _args(output_dir={out!r})).train()
print("rank finished training")
"""


def test_rank_raising_under_torchrun_fails_the_job_fast_with_the_original_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT.format(tests=os.path.join(ROOT, "tests"), out=str(tmp_path / "out")))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", str(script)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert f"RuntimeError: boom: rank 1 failed at step {FAIL_STEP}" in output
    assert "rank finished training" not in output


def failing_rank(rank: int, tmp: str, mode: str, stall_seconds: float = 0.0, ddp_timeout: float = 600.0) -> dict:
    """Train; report (instead of raising) how training ended on this rank, and how fast."""
    module = FailingToy(mode, stall_seconds)
    trainer = Trainer(module, _args(output_dir=tmp, ddp_timeout=ddp_timeout))
    started = time.monotonic()
    try:
        trainer.train()
        error = None
    except Exception as caught:  # the test inspects it
        error = f"{type(caught).__name__}: {caught}"
    return {
        "error": error,
        "seconds": time.monotonic() - started,
        "ended_at": time.time(),
        "woke_at": module.woke_at,
        "group_alive": dist.is_initialized(),
    }


def test_peer_of_a_raising_rank_fails_instead_of_hanging_and_groups_are_destroyed(tmp_path):
    # No torchrun agent here to kill the survivors: the framework itself must not hang.
    peer, failed = run_ranks(failing_rank, timeout=60, tmp=str(tmp_path), mode="raise")
    assert failed["error"] == f"RuntimeError: boom: rank 1 failed at step {FAIL_STEP}"
    assert peer["error"] is not None and peer["seconds"] < 30
    assert not failed["group_alive"] and not peer["group_alive"]  # both left the process group


def test_ddp_timeout_bounds_the_wait_for_a_stalled_rank(tmp_path):
    # Rank 1 stalls for 8 s without dying; with ddp_timeout=2 rank 0 gives up before it wakes.
    waiting, stalled = run_ranks(failing_rank, timeout=60, tmp=str(tmp_path), mode="stall", stall_seconds=8.0, ddp_timeout=2.0)
    error = waiting["error"]
    assert error is not None and "Timed out" in error and "ddp_timeout=2s" in error and "--trainer.ddp_timeout" in error, waiting
    assert waiting["ended_at"] < stalled["woke_at"]
    assert stalled["error"] is not None  # its peer is gone when it wakes up
    assert not waiting["group_alive"] and not stalled["group_alive"]
