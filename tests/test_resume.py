"""Exact resume on one process: real training processes are SIGKILLed and restarted.

Each run is ``tests/resume_script.py`` in a fresh Python process (a toy MLP with dropout,
4 epochs of 8 optimizer steps, 4 micro-batches per step, a checkpoint every 3 steps and at
every epoch end, ``resume="auto"``). A killed run is restarted with the same command until
it finishes; its final parameters must be bitwise equal to an uninterrupted run's and its
metric history identical.
"""

import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest
import torch

from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments, storage

pytestmark = pytest.mark.slow  # each test trains in several fresh processes

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")

# The script's defaults, from which the expected resume points follow.
N_TRAIN, BATCH, MICRO, SAVE_EVERY = 128, 16, 4, 3
STEPS_PER_EPOCH = N_TRAIN // BATCH
ACCUMULATION = BATCH // MICRO


def run_script(out: os.PathLike, *arguments: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run([sys.executable, SCRIPT, str(out), *arguments], capture_output=True, text=True, timeout=180, env=env)


def finish(out: os.PathLike, *arguments: str) -> subprocess.CompletedProcess:
    process = run_script(out, *arguments)
    assert process.returncode == 0, f"run failed ({process.returncode}):\n{process.stdout}\n{process.stderr}"
    assert "FINISHED at step" in process.stdout
    return process


def expect_killed(out: os.PathLike, marker: str, *arguments: str) -> subprocess.CompletedProcess:
    process = run_script(out, *arguments)
    assert process.returncode == -signal.SIGKILL, (
        f"expected SIGKILL, got {process.returncode}:\n{process.stdout}\n{process.stderr}"
    )
    assert marker in process.stdout, process.stdout
    return process


def result(out: os.PathLike) -> Dict[str, Any]:
    return torch.load(os.path.join(out, "result.pt"), weights_only=True)


def checkpoint_files(out: os.PathLike) -> List[str]:
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("checkpoint-") and n.endswith(".pt"))


def assert_all_checkpoints_load(out: os.PathLike) -> None:
    """Every file under a checkpoint name is complete and loads (no half file ever has one)."""
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=os.path.join(out, "checkpoints")))
    names = checkpoint_files(out)
    assert names, "no checkpoint was written"
    for name in names:
        checkpoint = checkpointer.read(os.path.join(out, "checkpoints", name))
        assert name == f"checkpoint-{checkpoint.global_step:09d}.pt"


def resume_step(epoch: int, micro_batch: int) -> int:
    """The step of the checkpoint a run killed right after (epoch, micro_batch) resumes from."""
    steps_done = epoch * STEPS_PER_EPOCH + micro_batch // ACCUMULATION  # killed before that cycle's step
    epoch_start = epoch * STEPS_PER_EPOCH
    return max(steps_done - steps_done % SAVE_EVERY, epoch_start)


def loaded_step(process: subprocess.CompletedProcess) -> int:
    lines = [line for line in process.stderr.splitlines() if "loaded checkpoint" in line]
    assert len(lines) == 1, process.stderr
    return int(lines[0].rsplit("step ", 1)[1].rstrip(")"))


def assert_same_run(reference: Dict[str, Any], resumed: Dict[str, Any]) -> None:
    assert torch.equal(resumed["params"], reference["params"]), (
        f"parameters differ: max |diff| = {(resumed['params'] - reference['params']).abs().max().item()}"
    )
    assert resumed["step"] == reference["step"]
    assert resumed["history"] == reference["history"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    finish(out)
    return result(out)


def test_killed_at_four_points_resumes_bitwise_exact(tmp_path, reference):
    # (kill point, what it exercises, expected checkpoint step to resume from)
    kills = [
        ("mb:1:17", "mid-epoch, mid accumulation cycle", resume_step(1, 17)),
        ("begin:2", "right after the epoch-end checkpoint", 2 * STEPS_PER_EPOCH),
        ("mb:2:31", "last micro-batch of an epoch, before its optimizer step", resume_step(2, 31)),
        ("mb:3:13", "a later epoch, mid-epoch", resume_step(3, 13)),
    ]
    assert 17 % ACCUMULATION != ACCUMULATION - 1  # the first kill is inside an accumulation cycle
    arguments = [argument for spec, _, _ in kills for argument in ("--kill", spec)]
    previous = None
    for spec, _, _ in kills:
        process = expect_killed(tmp_path, f"KILLING at {spec}", *arguments)
        if previous is not None:
            assert loaded_step(process) == previous
        assert_all_checkpoints_load(tmp_path)
        previous = next(step for s, _, step in kills if s == spec)
    process = finish(tmp_path, *arguments)
    assert loaded_step(process) == previous
    assert_same_run(reference, result(tmp_path))
    assert_all_checkpoints_load(tmp_path)


def test_crash_while_saving_keeps_previous_checkpoint(tmp_path, reference):
    crash_step = 21
    expect_killed(tmp_path, "KILLING in the middle of a checkpoint write", "--kill", f"save:{crash_step}")
    directory = tmp_path / "checkpoints"
    names = sorted(os.listdir(directory))
    half_files = [name for name in names if name.endswith(storage.TEMPORARY_SUFFIX)]
    assert len(half_files) == 1 and half_files[0].startswith(f".checkpoint-{crash_step:09d}.pt."), names
    assert (directory / half_files[0]).stat().st_size > 0  # it really died mid-write
    with pytest.raises(storage.CorruptCheckpoint):
        storage.verify(*storage.resolve(str(directory / half_files[0])))
    assert f"checkpoint-{crash_step:09d}.pt" not in names
    assert_all_checkpoints_load(tmp_path)
    previous = crash_step - SAVE_EVERY
    assert checkpoint_files(tmp_path)[-1] == f"checkpoint-{previous:09d}.pt"

    process = finish(tmp_path, "--kill", f"save:{crash_step}")
    assert loaded_step(process) == previous
    assert_same_run(reference, result(tmp_path))
    assert not [name for name in os.listdir(directory) if name.endswith(storage.TEMPORARY_SUFFIX)]  # cleaned up


def test_truncated_newest_checkpoint_is_reported_and_skipped(tmp_path, reference):
    expect_killed(tmp_path, "KILLING at mb:2:30", "--kill", "mb:2:30")
    newest = checkpoint_files(tmp_path)[-1]
    path = tmp_path / "checkpoints" / newest
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    process = finish(tmp_path, "--kill", "mb:2:30")
    warnings = [line for line in process.stderr.splitlines() if "WARNING" in line and "unreadable" in line]
    assert len(warnings) == 1 and str(path) in warnings[0] and "truncated" in warnings[0], process.stderr
    newest_step = int(newest[len("checkpoint-") : -len(".pt")])
    assert loaded_step(process) < newest_step
    assert loaded_step(process) == max(s for s in range(newest_step) if s % SAVE_EVERY == 0 or s % STEPS_PER_EPOCH == 0)
    assert_same_run(reference, result(tmp_path))
    assert_all_checkpoints_load(tmp_path)  # the truncated file was replaced by the resumed run's save


# -- preemption: real signals ------------------------------------------------------------


def checkpoint_steps(out: os.PathLike) -> List[int]:
    return [int(name[len("checkpoint-") : -len(".pt")]) for name in checkpoint_files(out)]


def test_sigterm_saves_at_the_step_boundary_exits_75_and_resumes_bitwise(tmp_path, reference):
    # The signal arrives after micro-batch 17 of epoch 1, inside the accumulation cycle of
    # micro-batches 16-19: the step finishes, its checkpoint is written, the run exits 75.
    process = run_script(tmp_path, "--send-signal", "mb:1:17=SIGTERM")
    assert process.returncode == 75, f"{process.returncode}\n{process.stdout}\n{process.stderr}"
    stop_step = STEPS_PER_EPOCH + 17 // ACCUMULATION + 1
    assert f"SIGTERM received: saving a checkpoint at step {stop_step}" in process.stderr, process.stderr
    assert f"STEP {stop_step}\n" in process.stdout and f"STEP {stop_step + 1}\n" not in process.stdout
    assert checkpoint_steps(tmp_path)[-1] == stop_step
    assert_all_checkpoints_load(tmp_path)

    process = finish(tmp_path, "--send-signal", "mb:1:17=SIGTERM")
    assert loaded_step(process) == stop_step
    assert_same_run(reference, result(tmp_path))


def _start(out: os.PathLike, *arguments: str) -> subprocess.Popen:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.Popen(
        [sys.executable, SCRIPT, str(out), *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_for_line(process: subprocess.Popen, prefix: str) -> List[str]:
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the run ended before printing {prefix!r}: {''.join(lines)}{process.stderr.read()}")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGUSR1"])
def test_signal_from_outside_while_training_stops_cleanly_and_resumes_bitwise(tmp_path, reference, signal_name):
    process = _start(tmp_path, "--step-sleep", "0.05")
    _wait_for_line(process, "STEP 3")
    sent = time.monotonic()
    process.send_signal(getattr(signal, signal_name))
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, f"{process.returncode}\n{stdout}\n{stderr}"
    assert time.monotonic() - sent < 10
    stop_step = checkpoint_steps(tmp_path)[-1]
    assert f"{signal_name} received: saving a checkpoint at step {stop_step}" in stderr
    finish(tmp_path)
    assert_same_run(reference, result(tmp_path))


def test_second_signal_aborts_at_once_and_keeps_the_previous_checkpoint(tmp_path):
    process = _start(tmp_path, "--step-sleep", "3", "--save-every", "1")
    _wait_for_line(process, "STEP 1")
    deadline = time.monotonic() + 60
    while not (os.path.isdir(tmp_path / "checkpoints") and checkpoint_steps(tmp_path) == [1]) and time.monotonic() < deadline:
        time.sleep(0.05)  # step 1's checkpoint and stop check done: a signal now lands inside step 2
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)  # the next step boundary is ~2.5 s away
    time.sleep(0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM
    assert time.monotonic() - sent < 2.5  # did not wait for the step to finish
    assert checkpoint_steps(tmp_path) == [1]
    assert_all_checkpoints_load(tmp_path)


def test_an_unknown_preemption_signal_is_refused_by_name():
    from framework import TrainerArguments

    with pytest.raises(ValueError, match=r"preemption_signals: 'SIGFOO' is not a signal .* allowed: .*SIGTERM"):
        TrainerArguments(preemption_signals="SIGTERM,SIGFOO")
    assert TrainerArguments(preemption_signals="").preemption_signals == ""  # catches none


def test_a_stop_requested_without_a_signal_leaves_the_first_signal_caught():
    # framework/lifecycle/launcher_watch.py asks for the stop when the launcher dies; a SIGTERM sent to
    # the orphan afterwards must still be the caught first signal, not the fatal second one.
    from framework.lifecycle.preemption import PreemptionHandler, parse_signals

    handler = PreemptionHandler(parse_signals("SIGINT"))
    with handler:
        handler.request("the loss of its launcher")
        os.kill(os.getpid(), signal.SIGINT)  # caught: no KeyboardInterrupt
        assert handler.requested and handler.signal_name == "the loss of its launcher"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second signal aborts at once
            time.sleep(1)
