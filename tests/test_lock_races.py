"""The run lock against pauses and races, with real processes and real signals.

A run paused with SIGSTOP past the stale window keeps its lock on its host; when another host
took it over, the paused run, continued, stops and touches nothing. 300 processes taking over one
stale lock at once leave one holder. Reruns started together take distinct ``version_<N>``.
The runs are ``tests/lock_script.py`` (stale window 2 s, heartbeat 0.2 s); "another host" is the
same command in its own UTS namespace (``unshare -u``) with another host name.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from framework.run.run_lock import LOCK_NAME

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "lock_script.py")
STALE = 2.0


def environment():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def start(out, *arguments, host=None):
    command = [sys.executable, SCRIPT, str(out), "--stale", str(STALE), *arguments]
    if host is not None:  # another host: its own host name, the same files
        command = ["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())


class Output:
    """The lines a process printed so far (read without blocking on a pipe that stays open)."""

    def __init__(self, process):
        self.process, self.lines = process, []
        os.set_blocking(process.stdout.fileno(), False)

    def read(self):
        while True:
            line = self.process.stdout.readline()
            if not line:
                return self.lines
            self.lines.append(line.rstrip("\n"))

    def steps(self):
        return [int(line.split()[1]) for line in self.read() if line.startswith("STEP ")]

    def wait_for_step(self, step, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not any(s >= step for s in self.steps()):
            assert self.process.poll() is None, "\n".join(self.read())[-3000:]
            assert time.monotonic() < deadline, "timed out\n" + "\n".join(self.read())[-3000:]
            time.sleep(0.05)

    def finish(self, timeout=60.0):
        self.process.wait(timeout=timeout)
        os.set_blocking(self.process.stdout.fileno(), True)
        self.lines += [line.rstrip("\n") for line in self.process.stdout.read().splitlines()]
        return "\n".join(self.lines)


def snapshot(directory):
    """Every file under ``directory``: (inode, size, mtime) by relative path (the lock file aside)."""
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            if name != LOCK_NAME:
                status = os.lstat(path)
                found[os.path.relpath(path, directory)] = (status.st_ino, status.st_size, status.st_mtime_ns)
    return found


def stopped(process):
    process.send_signal(signal.SIGSTOP)
    with open(f"/proc/{process.pid}/stat") as handle:
        while handle.read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
            handle.seek(0)


@pytest.mark.slow
def test_a_paused_run_keeps_its_lock_on_its_host_whatever_its_heartbeat(tmp_path):
    out = tmp_path / "run"
    first = Output(start(out))
    try:
        first.wait_for_step(2)
        stopped(first.process)
        time.sleep(STALE + 1.0)  # its heartbeat is older than the stale window: its pid lives, with its start time
        second = Output(start(out))  # the same command again, on the same host
        assert second.finish() and second.process.returncode == 4, "\n".join(second.lines)[-3000:]
        assert f"is in use by a live run (pid {first.process.pid} on host" in second.finish()
        first.process.send_signal(signal.SIGCONT)
        first.wait_for_step(max(first.steps()) + 2)  # trains on, its lock its own
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.process.pid
    finally:
        first.process.send_signal(signal.SIGCONT)
        first.process.terminate()
    assert first.finish() and first.process.returncode == 75, first.finish()[-3000:]
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_paused_run_whose_lock_another_host_took_stops_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    first = Output(start(out))
    second = None
    try:
        first.wait_for_step(2)
        stopped(first.process)
        paused_at = max(first.steps())
        time.sleep(STALE + 1.0)
        second = Output(start(out, host="node-b"))  # the same command on another host: the paused run looks dead
        second.wait_for_step(paused_at + 3)  # newer checkpoints than the paused run's
        stopped(second.process)  # hold still: whatever changes now is the first run's doing
        before = snapshot(tmp_path)
        assert json.loads((out / LOCK_NAME).read_text())["host"] == "node-b"
        first.process.send_signal(signal.SIGCONT)
        output = first.finish()
        assert first.process.returncode == 3, output[-3000:]
        assert "LOCK LOST: the run lock" in output and "taken over by another run (pid" in output
        assert "writes, renames and deletes nothing more" in output
        assert snapshot(tmp_path) == before  # no checkpoint written, renamed .stale or deleted; no temporary removed
        assert max(first.steps()) <= paused_at + 1  # stopped at its next step boundary
        assert json.loads((out / LOCK_NAME).read_text())["host"] == "node-b"  # its lock left to the new holder
        second.process.send_signal(signal.SIGCONT)
        second.wait_for_step(max(second.steps()) + 2)  # the second run trains on, saving
        second.process.terminate()
        assert second.finish() and second.process.returncode == 75, "\n".join(second.lines)[-3000:]
    finally:
        for process in (first.process, second and second.process):
            if process:
                process.send_signal(signal.SIGCONT)
                process.kill()
    assert not [path for path in snapshot(tmp_path) if path.endswith(".stale")]


TAKERS = r"""
import json, os, socket, sys, time, types
root, directory, count, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
for name in ("framework", "framework.run"):  # the lock modules alone: no torch in 300 processes
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = package
from framework.run import run_lock
os.makedirs(directory, exist_ok=True)
path = os.path.join(directory, run_lock.LOCK_NAME)
if kind == "dead-pid":
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    holder = {"pid": dead, "host": socket.gethostname(), "started": time.time(), "heartbeat": time.time(), "token": "x"}
else:
    holder = {"pid": 4242, "host": "node-elsewhere", "started": time.time(), "heartbeat": time.time(), "token": "y"}
with open(path, "w") as handle:
    json.dump(holder, handle)
os.utime(path, (time.time() - 60, time.time() - 60))
go_read, go_write = os.pipe()
end_read, end_write = os.pipe()
results_read, results_write = os.pipe()
children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        os.close(go_write); os.close(end_write)
        os.read(go_read, 1)  # every child waits here until the parent lets them all go at once
        lock = run_lock.RunLock(directory, stale_after_seconds=30.0, heartbeat_seconds=0.05)
        try:
            lock.acquire()
            verdict = "won"
        except run_lock.RunLocked as error:
            verdict = "refused" if "in use by a live run" in str(error) or "right now" in str(error) else repr(error)
        os.write(results_write, (json.dumps([os.getpid(), verdict]) + "\n").encode())
        os.read(end_read, 1)  # hold what was won until every child has answered
        os._exit(0)
    children.append(pid)
os.close(go_read); os.close(end_read); os.close(results_write)
time.sleep(0.5)
os.close(go_write)
answers, buffer = [], b""
while len(answers) < count:
    chunk = os.read(results_read, 65536)
    if not chunk:
        break
    buffer += chunk
    *lines, buffer = buffer.split(b"\n")
    answers += [json.loads(line) for line in lines]
holder = json.load(open(path))
os.close(end_write)
for pid in children:
    os.waitpid(pid, 0)
print(json.dumps({"answers": answers, "holder": holder["pid"]}))
"""


@pytest.mark.parametrize("kind", ["dead-pid", "old-heartbeat-of-another-host"])
def test_300_simultaneous_takeovers_of_one_stale_lock_leave_exactly_one_holder(tmp_path, kind):
    result = subprocess.run(
        [sys.executable, "-c", TAKERS, ROOT, str(tmp_path / "run"), "300", kind],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    verdicts = [verdict for _, verdict in found["answers"]]
    assert len(verdicts) == 300 and set(verdicts) <= {"won", "refused"}, set(verdicts)
    winners = [pid for pid, verdict in found["answers"] if verdict == "won"]
    assert len(winners) == 1, f"{len(winners)} processes hold the lock"
    assert found["holder"] == winners[0]  # the file names the one winner
    assert sorted(os.listdir(tmp_path / "run")) == [LOCK_NAME]  # no claim or candidate file left behind


@pytest.mark.slow
def test_reruns_started_together_take_distinct_versions(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("trainer: {}\n")  # a finished run lives there
    runs = [Output(start(out, "--resume", "", "--epochs", "1", "--step-sleep", "0")) for _ in range(2)]
    outputs = [run.finish(timeout=120) for run in runs]
    assert [run.process.returncode for run in runs] == [0, 0], "\n".join(outputs)[-3000:]
    chosen = sorted(line.split("DONE in ")[1] for output in outputs for line in output.splitlines() if "DONE in" in line)
    assert chosen == [str(out / f"version_{n}") for n in (1, 2)], chosen
    for directory in chosen:
        assert os.path.isfile(os.path.join(directory, "config.yaml")) and not os.path.exists(os.path.join(directory, LOCK_NAME))
