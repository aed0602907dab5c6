"""Orphaned workers (framework/lifecycle/launcher_watch.py) and the run lock under torchrun (2 gloo ranks).

One real torchrun job trains ``tests/resume_script.py``; the same command started again
meanwhile (a double submit) is refused on both ranks, naming the holder. Then the first
torchrun is killed with SIGKILL: its workers, left running, notice within seconds, agree on
a stop step without the dead agent's store, save a checkpoint there and exit. The same
command started once more resumes from that checkpoint (the same run id).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from framework.run.run_lock import LOCK_NAME

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")


def torchrun_command(out, *arguments):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.1",
        SCRIPT,
        str(out),
        "--backend",
        "ddp",
        *arguments,
    ]


def environment():
    path = os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def children(pid):
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(name))
    return found


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_orphaned_workers_stop_with_a_checkpoint_and_a_second_launch_is_refused(tmp_path):
    out, log_path = tmp_path / "run", tmp_path / "first.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(
            torchrun_command(out, "--epochs", "1000", "--step-sleep", "0.2"),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment(),
        )
    workers = []
    try:
        assert wait_for(lambda: "STEP 2" in log_path.read_text(), 120), log_path.read_text()[-3000:]
        workers = children(first.pid)
        assert len(workers) == 2
        holder = int((out / LOCK_NAME).read_text().split('"pid": ')[1].split(",")[0])
        assert holder in workers

        # the same command again while the first job lives: refused on both ranks, before step 1
        second = subprocess.run(torchrun_command(out), capture_output=True, text=True, timeout=240, env=environment())
        output = second.stdout + second.stderr
        assert second.returncode != 0 and "STARTED" not in output, output[-3000:]
        assert f"is in use by a live run (pid {holder} on host {socket.gethostname()}" in output, output[-3000:]
        assert "rank zero refused to start the run" in output, output[-3000:]  # rank 1 learned it and exited
        assert first.poll() is None and all(running(pid) for pid in workers)

        first.send_signal(signal.SIGKILL)  # an OOM killer takes the launcher: the workers are orphaned
        first.wait()
        killed_at = time.monotonic()
        assert wait_for(lambda: not any(running(pid) for pid in workers), 60), "orphaned workers kept running"
        stopped_after = time.monotonic() - killed_at
    finally:
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    text = log_path.read_text()
    assert "the loss of its launcher (torchrun, pid" in text and "saving a checkpoint at step" in text, text[-3000:]
    stop_step = int(text.split("saving a checkpoint at step ")[1].split()[0])
    steps = [int(step) for step in re.findall(r"STEP (\d+)", text)]  # the ranks' lines may interleave
    assert max(steps) == stop_step  # no step after the stop
    names = sorted(name for name in os.listdir(out / "checkpoints") if name.endswith(".pt"))
    assert names[-1] == f"checkpoint-{stop_step:09d}.pt"
    assert "DistNetworkError" not in text.split("saving a checkpoint at step")[1]  # ended by the stop, not a broken pipe
    assert not (out / LOCK_NAME).exists()
    assert stopped_after < 30, stopped_after
    run_id = torch.load(out / "checkpoints" / names[-1], weights_only=True)["trainer"]["run_id"]

    # the same command once more resumes the orphans' checkpoint: the same run
    third = subprocess.run(
        torchrun_command(out, "--epochs", "1000", "--max-steps", str(stop_step + 2)),
        capture_output=True,
        text=True,
        timeout=240,
        env=environment(),
    )
    output = third.stdout + third.stderr
    assert third.returncode == 0, output[-3000:]
    assert f"STARTED at step {stop_step}" in output and f"FINISHED at step {stop_step + 2}" in output
    newest = sorted(name for name in os.listdir(out / "checkpoints") if name.endswith(".pt"))[-1]
    assert torch.load(out / "checkpoints" / newest, weights_only=True)["trainer"]["run_id"] == run_id
