"""The run lock (framework/run/run_lock.py): one live run per output directory.

Real processes hold real lock files; a dead holder is a real process that has exited.
The 2-rank refusal (every rank exits) is tested under torchrun in test_launcher_watch.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.run.run_lock import LOCK_NAME, STALE_AFTER_SECONDS, RunLocked, process_start_time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")


def start_script(out, *arguments):
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    command = [sys.executable, SCRIPT, str(out), "--backend", "sp", *arguments]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    shared = tmp_path / "shared-checkpoints"  # outside its output_dir: locked too
    first = start_script(out, "--epochs", "100", "--step-sleep", "0.05", "--save-dir", str(shared))
    try:
        wait_for(lambda: shared.exists() and any(name.startswith("checkpoint-") for name in os.listdir(shared)))
        holder = json.loads((out / LOCK_NAME).read_text())
        assert (holder["pid"], holder["host"]) == (first.pid, socket.gethostname())
        with pytest.raises(RunLocked, match=f"pid {first.pid} on host {socket.gethostname()}") as refused:
            train(tmp_path, save_dir=str(shared))  # the same directories, resume="auto": a double submit
        assert "kill" not in str(refused.value) and "older than 120 s is taken over" in str(refused.value)
        with pytest.raises(RunLocked, match=f"save_dir {str(shared)!r} is in use by a live run .pid {first.pid}"):
            train(tmp_path / "elsewhere", save_dir=str(shared))  # another output_dir, the same save_dir, at once
        assert not (tmp_path / "elsewhere" / "run" / LOCK_NAME).exists()  # its output_dir lock given back
        assert first.poll() is None  # the first run trains on
        first.send_signal(signal.SIGTERM)  # a preempted run gives its lock back too
        output, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 75, output[-3000:]
    assert not (out / LOCK_NAME).exists() and not (shared / LOCK_NAME).exists()


def dead_pid():
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def write_lock(directory, pid, host, age, started=None):
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    started = now - age if started is None else started
    (directory / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host, "started": started, "heartbeat": now - age}))


def train(tmp_path, module=None, save_dir=None):
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto", save_dir=save_dir)
    trainer = Trainer(module or ToyModule(n_train=64, scheduler=None), toy_args(tmp_path, checkpoints))
    trainer.train()
    return trainer


@pytest.fixture
def live_process():
    """A live process on this host that holds no lock (what now owns a dead run's pid)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize(
    "host, pid, age",
    [
        ("this host", "dead", 0.0),
        ("node-elsewhere", 1, STALE_AFTER_SECONDS + 5),
        ("this host", "live", STALE_AFTER_SECONDS + 5),  # pid reused, heartbeat stale
        ("this host", "live", 30.0),  # pid reused: its process started after the lock was taken
        ("this host", "self", 30.0),  # a restarted container: this very process has the dead run's pid
    ],
    ids=["dead-pid-on-this-host", "old-heartbeat-from-another-host", "live-pid-old-heartbeat", "reused-pid", "own-pid"],
)
def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_warning(tmp_path, framework_log, host, pid, age, request):
    host = socket.gethostname() if host == "this host" else host
    if pid == "live":
        process = request.getfixturevalue("live_process")
        wait_for(lambda: os.path.exists(f"/proc/{process.pid}"))
        pid = process.pid
    started = None
    if pid == "self":  # the lock was taken before this process started: by an earlier process with its pid
        pid, started = os.getpid(), process_start_time(os.getpid()) - 60
    pid = dead_pid() if pid == "dead" else pid
    write_lock(tmp_path / "run", pid, host, age, started)
    trainer = train(tmp_path)
    assert trainer.global_steps_finished == 2
    assert any("taking over the run lock" in line and f"pid {pid} on host {host}" in line for line in framework_log)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released at the end


def test_a_fresh_lock_of_another_host_is_refused_and_left_alone(tmp_path):
    write_lock(tmp_path / "run", 4242, "node-elsewhere", age=1.0)
    before = (tmp_path / "run" / LOCK_NAME).read_text()
    with pytest.raises(RunLocked, match="pid 4242 on host node-elsewhere"):
        train(tmp_path)
    assert (tmp_path / "run" / LOCK_NAME).read_text() == before
    assert os.listdir(tmp_path / "run") == [LOCK_NAME]  # refused before anything was written


class Failing(ToyModule):
    def train_step(self, global_step, batch, device):
        raise ZeroDivisionError("a bug in train_step")


def test_the_lock_is_released_when_training_raises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        train(tmp_path, Failing(n_train=64, scheduler=None))
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_the_heartbeat_is_refreshed_and_a_taken_over_lock_is_left_to_its_new_holder(tmp_path, framework_log):
    from framework.run.run_lock import RunLock

    lock = RunLock(str(tmp_path), heartbeat_seconds=0.05)
    lock.acquire()
    first = json.loads((tmp_path / LOCK_NAME).read_text())
    wait_for(lambda: json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first["heartbeat"], timeout=10)
    # another host took the lock over (it judged this one stale): this run stops beating, leaves it alone

    def take_over() -> bool:
        if any("was taken over by another run" in line for line in framework_log):
            return True
        write_lock(tmp_path, 4242, "node-elsewhere", age=0.0)  # again: a beat read before it may have overwritten it
        return False

    wait_for(take_over, timeout=10)
    taken = (tmp_path / LOCK_NAME).read_text()
    time.sleep(0.2)  # several heartbeat periods: none writes any more
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == taken
