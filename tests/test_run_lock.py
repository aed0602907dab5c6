"""The run lock (framework/run/run_lock.py): one live run per output directory.

Real processes hold real lock files; a dead holder is a real process that has exited.
The 2-rank refusal (every rank exits) is tested under torchrun in test_launcher_watch.py.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from toy import ToyModule, toy_args

from framework import Trainer
from framework.callbacks import Callback
from framework.checkpoint import DefaultCheckpointerArguments
from framework.run.run_lock import LOCK_NAME, STALE_AFTER_SECONDS, RunLocked, RunLockLost, process_start_time

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
        assert "kill" not in str(refused.value) and "heartbeat is older than 120 s" in str(refused.value)
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


def write_lock(directory, pid, host, age, started=None, **fields):
    """A lock file as a run (of this version, or with ``fields`` of another) left it, its heartbeat ``age`` s old."""
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    started = now - age if started is None else started
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": host, "started": started, "heartbeat": now - age, **fields}))
    os.utime(path, (now - age, now - age))  # the heartbeat is the file's mtime


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
    first = (tmp_path / LOCK_NAME).stat().st_mtime_ns
    wait_for(lambda: (tmp_path / LOCK_NAME).stat().st_mtime_ns > first, timeout=10)
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


def acquire_within(lock, seconds=10.0):
    """``lock.acquire()`` in a thread: whatever it raises, or "hung" when it has not returned in time."""
    outcome = []

    def attempt():
        try:
            lock.acquire()
            outcome.append(None)
        except BaseException as error:  # handed to the test
            outcome.append(error)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else "hung"


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_naming_it_never_opened(tmp_path, kind):
    path = tmp_path / LOCK_NAME
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading without O_NONBLOCK waits for a writer forever
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere")
    from framework.run.run_lock import RunLock

    error = acquire_within(RunLock(str(tmp_path)))
    named = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symbolic link"}[kind]
    assert isinstance(error, RunLocked), error
    assert f"{path} is {named}, not a regular file" in str(error) and "remove" in str(error)
    assert os.path.lexists(path) and sorted(os.listdir(tmp_path)) == sorted(
        [LOCK_NAME] + (["elsewhere"] if kind == "symlink" else [])
    )


@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"pid": "4242", "host": "node1", "started": 0, "heartbeat": 0}', "pid is '4242', not a positive integer"),
        ('{"pid": true, "host": "node1", "started": 0, "heartbeat": 0}', "pid is True"),
        ('{"pid": 4242, "host": ["node1"], "started": 0, "heartbeat": 0}', "host is ['node1'], not a host name"),
        ('{"pid": 4242, "host": "node1", "started": "now", "heartbeat": 0}', "started is 'now'"),
        ('{"pid": 4242, "host": "node1", "started": 0, "heartbeat": NaN}', "heartbeat is nan"),
        ("[4242]", "not a JSON object (list)"),
        ("\x00\xff garbage", "not JSON"),
        ("[" * 100000, "larger than 4096 bytes"),
        (
            "[" * 2000 + "]" * 2000,
            "JSON",
        ),  # "not JSON" (too deep), or "not a JSON object (list)" where a test raised the recursion limit
        ("", "not JSON"),
    ],
    ids=["string-pid", "bool-pid", "list-host", "string-time", "nan-heartbeat", "list", "binary", "huge", "deep", "empty"],
)
def test_a_regular_lock_file_whose_fields_do_not_parse_is_reported_and_taken_over(tmp_path, framework_log, content, problem):
    from framework.run.run_lock import RunLock

    (tmp_path / LOCK_NAME).write_text(content)
    lock = RunLock(str(tmp_path))
    assert acquire_within(lock) is None
    try:
        assert any("taking over the run lock" in line and problem in line for line in framework_log), framework_log
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_lock_of_another_host_ages_by_the_filesystems_clock_not_the_holders(tmp_path):
    from framework.run.run_lock import RunLock

    ahead = time.time() + 3600  # the holder's clock runs an hour ahead; the file's mtime is stamped by the filesystem
    write_lock(tmp_path, 4242, "node-elsewhere", age=0.0, started=ahead, heartbeat=ahead)
    assert isinstance(acquire_within(RunLock(str(tmp_path), stale_after_seconds=1.0)), RunLocked)  # alive now
    time.sleep(1.5)  # it stopped beating: gone after the stale window, not after an hour
    lock = RunLock(str(tmp_path), stale_after_seconds=1.0)
    assert acquire_within(lock) is None
    lock.release()


def test_a_heartbeat_from_the_future_counts_as_now_within_the_skew_and_as_stale_beyond_it(tmp_path, framework_log):
    """Issue 49: a heartbeat a year ahead refused for a year, saying "heartbeat 0 s ago". Within 60 s of skew it
    counts as now and the message says how far ahead it is; beyond, no live holder's touch stamped it (a touch stamps
    the filesystem's now): taken over, the warning naming the real difference (mutant: the future check removed ->
    RunLocked for a year; the old max(0, ...) age -> "0 s ago")."""
    from framework.run.run_lock import RunLock

    write_lock(tmp_path / "near", 4242, "node-elsewhere", age=-30.0)  # 30 s ahead of this filesystem's clock
    error = acquire_within(RunLock(str(tmp_path / "near"), stale_after_seconds=1.0))
    assert isinstance(error, RunLocked) and re.search(r"heartbeat (29|30) s in the future", str(error)), error
    year = 365 * 24 * 3600.0
    write_lock(tmp_path / "far", 4242, "node-elsewhere", age=-year)
    lock = RunLock(str(tmp_path / "far"), stale_after_seconds=120.0)
    assert acquire_within(lock) is None
    try:
        taken = [line for line in framework_log if "taking over the run lock" in line]
        assert taken and re.search(r"heartbeat lies 3153(5|6)\d{3} s in the future", taken[0]), framework_log
        assert "0 s ago" not in taken[0] and "3153" in taken[0]
    finally:
        lock.release()


def held_like_a_run(output_dir, save_dir=None):
    """The locks a live run with these directories holds (taken by this test process, a live pid)."""
    from framework.run.run_directory import locked_directories
    from framework.run.run_lock import claim_run_lock

    class Checkpointer:
        pass

    checkpointer = Checkpointer()
    checkpointer.save_dir = str(save_dir or os.path.join(output_dir, "checkpoints"))
    return claim_run_lock(str(output_dir), None, locked_directories(str(output_dir), checkpointer))


def test_a_save_dir_inside_a_live_runs_directory_is_refused_but_its_version_folders_are_not(tmp_path):
    first = held_like_a_run(tmp_path / "a", save_dir=tmp_path / "a-checkpoints")  # holds a/ and a-checkpoints/
    try:
        with pytest.raises(RunLocked, match=r"save_dir '.*/a/checkpoints' lies inside '.*/a', which a live run holds"):
            train(tmp_path / "b", save_dir=str(tmp_path / "a" / "checkpoints"))  # the live run's default folder
        assert not (tmp_path / "a" / "checkpoints").exists() or os.listdir(tmp_path / "a" / "checkpoints") == []
        trainer = Trainer(ToyModule(n_train=64, scheduler=None), toy_args(tmp_path, output_dir=str(tmp_path / "a" / "version_1")))
        trainer.train()  # a rerun's version folder inside the live run's output_dir
    finally:
        first.release()


def test_a_run_whose_nested_save_dir_another_live_run_holds_is_refused(tmp_path):
    other = held_like_a_run(tmp_path / "elsewhere", save_dir=tmp_path / "run" / "checkpoints")  # pointed here first
    try:
        with pytest.raises(RunLocked, match=r"save_dir '.*/run/checkpoints' is in use by a live run"):
            train(tmp_path)  # its save_dir is <output_dir>/checkpoints: locked, nested or not
        assert not (tmp_path / "run" / LOCK_NAME).exists()  # its output_dir lock given back
    finally:
        other.release()


class TakenOverAt(Callback):
    """After optimizer step ``step``, another host takes the run's locks (it judged the run gone)."""

    def __init__(self, step, directories):
        self.step, self.directories = step, directories

    def on_end_optimizer_step(self, global_step):
        if global_step == self.step:
            for directory in self.directories:
                write_lock(directory, 4242, "node-elsewhere", age=0.0, token="theirs")


def test_a_run_whose_lock_was_taken_over_saves_nothing_more(tmp_path):
    run = tmp_path / "run"
    checkpoints = DefaultCheckpointerArguments(period=0, save_every_n_steps=1, resume="auto")
    taken = TakenOverAt(2, [run, run / "checkpoints"])
    trainer = Trainer(ToyModule(n_train=128, scheduler=None), toy_args(tmp_path, checkpoints, epochs=3), callbacks=[taken])
    with pytest.raises(RunLockLost, match=r"was taken over by another run \(pid 4242 on host node-elsewhere"):
        trainer.train()  # the heartbeat (every 10 s) has not looked yet: the save checks the lock itself
    assert sorted(os.listdir(run / "checkpoints")) == ["checkpoint-000000001.pt", LOCK_NAME]  # step 2's save refused
    for directory in (run, run / "checkpoints"):  # left to their new holder
        assert json.loads((directory / LOCK_NAME).read_text())["token"] == "theirs"


def test_a_run_whose_lock_was_taken_over_stops_at_its_next_step_boundary(tmp_path, monkeypatch):
    from framework.run import run_lock

    monkeypatch.setattr(run_lock, "HEARTBEAT_SECONDS", 0.02)
    run = tmp_path / "run"

    class Slow(ToyModule):
        def train_step(self, global_step, batch, device):
            time.sleep(0.02)
            return super().train_step(global_step, batch, device)

    checkpoints = DefaultCheckpointerArguments(period=0, save_at_end=False, resume="auto")
    taken = TakenOverAt(2, [run])
    trainer = Trainer(Slow(n_train=128, scheduler=None), toy_args(tmp_path, checkpoints, epochs=20), callbacks=[taken])
    with pytest.raises(RunLockLost):
        trainer.train()
    assert 2 < trainer.global_steps_finished < 10  # of 80: stopped a heartbeat or two after the takeover
    assert not (run / "checkpoints").exists() or os.listdir(run / "checkpoints") == []  # released: still its own


def test_a_fifo_swapped_in_after_the_lstat_is_refused_not_waited_on(tmp_path, monkeypatch):
    from framework.run import lock_file

    regular = tmp_path / "regular"
    regular.write_text("{}")
    path = tmp_path / LOCK_NAME
    os.mkfifo(path)  # what the open finds: the lstat below saw a regular file (a swap between the two)
    real_lstat = os.lstat
    monkeypatch.setattr(lock_file.os, "lstat", lambda p: real_lstat(regular) if str(p) == str(path) else real_lstat(p))
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(catch(lock_file.read_lock_file, str(path))), daemon=True)
    thread.start()
    thread.join(10)
    assert outcome and isinstance(outcome[0], lock_file.OddLockFile) and "is a FIFO, not a regular file" in str(outcome[0])


def catch(function, *arguments):
    try:
        return function(*arguments)
    except Exception as error:  # handed to the test
        return error
