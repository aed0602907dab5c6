"""Loggers chosen by name: the registry, a failing logger, and real MLflow and W&B runs read back
(one tracker run across a SIGTERM preemption, a kill -9 and the resumes; 2-rank DDP)."""

import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import torch
from tracking import csv_points, mlflow_artifacts, mlflow_points, mlflow_runs, wandb_offline_runs

from toy import ToyModule, toy_args

from framework import Trainer
from framework.callbacks import Callback
from framework.checkpoint import DefaultCheckpointerArguments
from framework.config.cli import parse_config
from framework.loggers import (
    Logger,
    LoggerStartFailed,
    available_loggers,
    build_loggers,
    register_logger,
    unregister_logger,
)
from framework.loggers.csv_logger import CSVLogger
from framework.loggers.tensorboard_logger import TensorBoardLogger

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")


def test_unknown_logger_name_is_refused_listing_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown logger 'mlfow'; known: csv, tensorboard, mlflow, wandb"):
        toy_args(tmp_path, loggers=["csv", "mlfow"])
    with pytest.raises(TypeError, match=r"allowed: a logger name or a framework\.loggers\.Logger instance"):
        toy_args(tmp_path, loggers=[3])


def test_cli_list_and_tensorboard_flag_choose_the_same_loggers(tmp_path):
    config = parse_config(argv=["--trainer.loggers", "[csv,tensorboard]", "--trainer.output_dir", str(tmp_path)])
    assert config.trainer.loggers == ["csv", "tensorboard"]
    by_name = [type(item) for item in build_loggers(config.trainer)]
    by_flag = [type(item) for item in build_loggers(toy_args(tmp_path, tensorboard=True))]
    assert by_name == by_flag == [CSVLogger, TensorBoardLogger]


class Recording(Logger):
    name = "recording"

    def __init__(self):
        self.records, self.statuses = [], []

    def log_metrics(self, records):
        self.records.extend(records)

    def finish(self, status):
        self.statuses.append(status)


class Broken(Logger):
    name = "broken"

    def log_metrics(self, records):
        raise OSError("No space left on device")


def test_registered_and_instance_loggers_receive_metrics_and_a_failing_one_never_stops_training(tmp_path, framework_log):
    recording = Recording()
    register_logger("recording", lambda args: recording)
    try:
        assert "recording" in available_loggers()
        checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "checkpoints"), period=1)
        args = toy_args(
            tmp_path, epochs=2, log_every_n_steps=2, loggers=["csv", "recording", Broken()], checkpointer_args=checkpoints
        )
        trainer = Trainer(ToyModule(n_train=64), args)
        history = trainer.train()
    finally:
        unregister_logger("recording")
    assert recording.records == history.records and recording.statuses == ["FINISHED"]
    warnings = [message for message in framework_log if "'broken' failed" in message]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], framework_log
    assert f"checkpoint-{trainer.global_steps_finished:09d}.pt" in os.listdir(tmp_path / "checkpoints")


class CountSteps(Callback):
    def __init__(self):
        self.steps = 0

    def on_end_optimizer_step(self, global_step):
        self.steps += 1


@pytest.mark.parametrize(
    "environment, cause",
    [
        ({"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}, "127.0.0.1"),  # server down
        ({"MLFLOW_TRACKING_URI": "file:mlruns", "MLFLOW_ALLOW_FILE_STORE": ""}, "MLFLOW_ALLOW_FILE_STORE"),  # store refused
    ],
    ids=["unreachable-server", "refused-file-store"],
)
def test_a_tracker_that_cannot_start_is_an_error_before_step_one(tmp_path, monkeypatch, environment, cause):
    monkeypatch.chdir(tmp_path)
    for name, value in environment.items():
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    checkpoints = DefaultCheckpointerArguments(save_dir=str(tmp_path / "checkpoints"))
    counter = CountSteps()
    args = toy_args(tmp_path, loggers=["csv", "mlflow"], checkpointer_args=checkpoints)
    with pytest.raises(LoggerStartFailed, match=r"logger 'mlflow' could not start \(") as failed:
        Trainer(ToyModule(n_train=64), args, callbacks=[counter]).train()
    assert cause in str(failed.value) and "--trainer.loggers" in str(failed.value)
    assert counter.steps == 0 and not (tmp_path / "checkpoints").exists()  # its run lock came and went: nothing left


def run_script(out, env, *arguments, expect):
    command = [sys.executable, SCRIPT, str(out), "--loggers", "csv,mlflow,wandb", *arguments]
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    assert process.returncode == expect, f"{process.returncode}:\n{process.stdout[-3000:]}\n{process.stderr[-5000:]}"
    return process


@pytest.fixture
def tracker_env(tmp_path):
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )


@pytest.mark.slow
def test_one_tracker_run_across_preemption_kill_and_resume(tmp_path, tracker_env):
    out, uri = tmp_path / "run", tracker_env["MLFLOW_TRACKING_URI"]
    # 4 epochs of 8 steps, a checkpoint every 3 steps, metrics every 5: SIGTERM in step 10, then
    # kill -9 in step 26 after step 25 was logged (the resumed run starts again at step 24).
    kills = ["--send-signal", "mb:1:9=SIGTERM", "--kill", "mb:3:5"]
    run_script(out, tracker_env, *kills, expect=75)
    (preempted,) = mlflow_runs(uri)
    assert preempted.info.status == "KILLED"
    run_script(out, tracker_env, *kills, expect=-signal.SIGKILL)
    run_script(out, tracker_env, *kills, expect=0)

    (run,) = mlflow_runs(uri)  # the same MLflow run all along
    assert os.path.isdir(tmp_path / "mlruns")  # MLflow's default artifact root, relative to the working directory
    assert run.info.run_id == preempted.info.run_id and run.info.status == "FINISHED"
    expected = csv_points(out)
    assert any(step == 25 for _, step, _ in expected)
    assert mlflow_points(uri, run.info.run_id) == expected  # every point once, none from the lost steps twice
    assert run.data.params["trainer.epochs"] == "4" and run.data.params["checkpointer.save_every_n_steps"] == "3"
    assert mlflow_artifacts(uri, run.info.run_id) == ["config.yaml", "metrics.png"]

    attempts = wandb_offline_runs(str(out))
    assert len(attempts) == 3 and len({attempt["run_id"] for attempt in attempts} - {None}) == 1  # a killed one may lack it
    assert attempts[-1]["exit_code"] == 0
    for attempt in attempts:
        assert set(attempt["points"]) <= set(expected)
    resumed_from = min(step for _, step, _ in attempts[-1]["points"])
    assert resumed_from > 24  # the resumed attempt did not send the restored history again


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_logs_one_tracker_run_from_rank_zero(tmp_path, tracker_env):
    out, uri = tmp_path / "run", tracker_env["MLFLOW_TRACKING_URI"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT, str(out)]
    arguments = ["--backend", "ddp", "--epochs", "2", "--loggers", "csv,mlflow,wandb"]
    process = subprocess.run(command + arguments, capture_output=True, text=True, timeout=300, env=tracker_env, cwd=tmp_path)
    assert process.returncode == 0, f"{process.stdout[-3000:]}\n{process.stderr[-5000:]}"
    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED"
    assert mlflow_points(uri, run.info.run_id) == csv_points(out)
    (attempt,) = wandb_offline_runs(str(out))
    assert attempt["points"] == csv_points(out) and attempt["exit_code"] == 0
    history = torch.load(out / "result.pt", weights_only=True)["history"]
    assert len(history) == sum(csv_points(out).values())


PLUGIN = """
import json, os
from framework.loggers import Logger


class JsonLinesLogger(Logger):
    name = "jsonl"

    def __init__(self, path):
        self.path = path

    def log_metrics(self, records):
        with open(self.path, "a") as handle:
            handle.writelines(json.dumps(record) + "\\n" for record in records)


def build(args):
    return JsonLinesLogger(os.path.join(args.output_dir, "metrics.jsonl"))
"""

FRESH_PROCESS = """
import sys
sys.path.insert(0, {tests!r})
from toy import ToyModule, toy_args
from framework import Trainer
Trainer(ToyModule(n_train=64), toy_args({out!r}, loggers=["csv", "jsonl"], log_every_n_steps=1)).train()
"""


@pytest.mark.slow
def test_entry_point_logger_is_chosen_by_name_in_a_fresh_process(tmp_path):
    (tmp_path / "my_logger_plugin.py").write_text(PLUGIN)
    dist_info = tmp_path / "my_logger_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-logger-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[framework.loggers]\njsonl = my_logger_plugin:build\n")
    root = os.path.dirname(HERE)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]), OMP_NUM_THREADS="1")
    script = FRESH_PROCESS.format(tests=HERE, out=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        logged = Counter((record["name"], record["step"], record["value"]) for record in map(json.loads, handle))
    assert logged == csv_points(str(tmp_path / "run")) and logged


def test_a_logger_given_as_a_string_is_one_logger(tmp_path):
    from framework import TrainerArguments

    assert TrainerArguments(loggers="csv").loggers == ["csv"]
    with pytest.raises(ValueError, match="unknown logger 'tensorbord'"):
        TrainerArguments(loggers="tensorbord")
    Trainer(ToyModule(n_train=32), toy_args(tmp_path, loggers="csv")).train()
    assert os.path.isfile(tmp_path / "run" / "metrics.csv")


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_leaves_no_mlflow_run_running(tmp_path, tracker_env):
    out, uri = tmp_path / "run", tracker_env["MLFLOW_TRACKING_URI"]
    command = [sys.executable, SCRIPT, str(out), "--loggers", "csv,mlflow", "--epochs", "1", "--kill", "mb:0:1"]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=tracker_env, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    left = os.listdir(out / "checkpoints") if os.path.isdir(out / "checkpoints") else []
    assert left in ([], ["run.lock"]), left  # killed before step 3's save: at most its (stale) lock
    (orphan,) = mlflow_runs(uri)
    assert orphan.info.status == "RUNNING"  # a SIGKILLed process ends nothing
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=tracker_env, cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout[-3000:]
    statuses = {run.info.run_id: run.info.status for run in mlflow_runs(uri)}
    assert statuses.pop(orphan.info.run_id) == "KILLED"  # ended by the next start
    assert list(statuses.values()) == ["FINISHED"]
