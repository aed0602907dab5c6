"""On a real one-node Slurm (tests/slurm_cluster.py): srun and sbatch train like torchrun,
several tasks with a single-process backend are refused, and jobs requeue themselves."""

import csv
import glob
import os
import subprocess
import sys

import pytest
import torch

from distributed import free_port
from slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

# A real one-node Slurm cluster (tests/slurm_cluster.py) whose jobs start 2-rank process groups.
pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "run.py")
# A short run of the README's example: 6 steps of 64 samples, a checkpoint at the end.
SHORT = [
    "--trainer.epochs",
    "1",
    "--trainer.max_train_steps_per_epoch",
    "6",
    "--trainer.log_every_n_steps",
    "2",
    "--trainer.disable_tqdm",
    "true",
]


def read_metrics(out):
    with open(os.path.join(out, "metrics.csv")) as handle:
        return [(row["epoch"], row["step"], row["name"], float(row["value"])) for row in csv.DictReader(handle)]


def files_written(out):
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)


def final_weights(out):
    [path] = glob.glob(os.path.join(out, "checkpoints", "*.pt"))
    return torch.load(path, weights_only=True)["module"]["model"]


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torchrun"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        EXAMPLE,
        "--backend",
        "ddp",
        "--trainer.output_dir",
        out,
        *SHORT,
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def assert_trained_like(out, output, reference):
    """Same weights and metrics as torchrun's 2 ranks, one run's files, one rank zero."""
    assert output.count("final val_accuracy=") == 1, output  # two independent copies would both print
    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(weights[name], expected[name], atol=1e-6, rtol=0), name
    assert read_metrics(out) == read_metrics(reference)
    assert files_written(out) == files_written(reference)  # one metrics.csv, one set of checkpoints


@pytest.mark.slow  # a torchrun reference run and 2 srun tasks: > 10 s; the sbatch recipe (srun inside) stays quick
def test_srun_two_tasks_train_like_torchrun(slurm_cluster, torchrun_reference, tmp_path):  # noqa: F811
    out = str(tmp_path / "srun")
    command = ["srun", "--ntasks=2", sys.executable, EXAMPLE, "--backend", "ddp", "--trainer.output_dir", out, *SHORT]
    result = slurm_cluster.run(command, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr + slurm_cluster.logs()
    assert_trained_like(out, result.stdout, torchrun_reference)


def test_example_sbatch_recipe_trains_like_torchrun(slurm_cluster, torchrun_reference, tmp_path):  # noqa: F811
    out = str(tmp_path / "sbatch")
    log = tmp_path / "job.log"
    arguments = [f"--output={log}", os.path.join(ROOT, "examples", "slurm.sbatch"), "--trainer.output_dir", out, *SHORT]
    job = slurm_cluster.sbatch_and_wait(arguments, cwd=ROOT, env={"PYTHON": sys.executable})
    output = log.read_text() if log.exists() else ""
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}\n{slurm_cluster.logs()}"
    assert_trained_like(out, output, torchrun_reference)


SP_SCRIPT = """
import sys
sys.path.insert(0, "tests")
from toy import ToyModule
from framework import Trainer, TrainerArguments
Trainer(ToyModule(), TrainerArguments(backend="sp", output_dir=sys.argv[1], disable_tqdm=True)).train()
"""


def test_several_tasks_with_a_single_process_backend_stop_before_training(slurm_cluster, tmp_path):  # noqa: F811
    out = str(tmp_path / "sp")
    result = slurm_cluster.run(["srun", "--ntasks=2", sys.executable, "-c", SP_SCRIPT, out], cwd=ROOT)
    assert result.returncode != 0
    assert "rank 1 of 2 processes started by srun, but the backend runs a single process" in result.stderr
    assert "--backend ddp" in result.stderr and "srun --ntasks=1" in result.stderr
    assert not os.path.exists(out)  # stopped before anything was written


BATCH_SHELL_SCRIPT = """#!/bin/bash
{python} -c '
import logging
from backends import build_backend
from framework import TrainerArguments
logging.basicConfig()
for name in ("sp", "ddp"):
    backend = build_backend(name, TrainerArguments(use_gpu=False))
    backend.setup()
    print(name, backend.cluster_environment.describe(), flush=True)
'
"""


def test_batch_script_of_a_two_task_job_is_one_process(slurm_cluster, tmp_path):  # noqa: F811
    # `python script.py` in the batch script (no srun) is one process, not a launch of 2:
    # `sp` runs, and `ddp` runs alone with a warning that srun would use both tasks.
    script = tmp_path / "one.sbatch"
    script.write_text(BATCH_SHELL_SCRIPT.format(python=sys.executable))
    log = tmp_path / "one.log"
    job = slurm_cluster.sbatch_and_wait(["--ntasks=2", f"--output={log}", str(script)], cwd=ROOT)
    output = log.read_text() if log.exists() else ""
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}"
    assert "sp slurm: rank 0 of 1 (local rank 0, node 0)" in output
    assert "ddp slurm: rank 0 of 1" in output
    assert "which has 2 tasks, but it runs as one process; start the training with srun" in output


REQUEUE_SCRIPT = """#!/bin/bash
{python} -c '
from backends.environments import detect_cluster_environment
environment = detect_cluster_environment()
print("name", environment.name, "requeues", environment.requeues, "restarts", environment.restart_count, flush=True)
print("requeued", environment.requeue(), flush=True)
'
sleep 60
"""


def test_requeue_from_inside_a_job(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "requeue.sbatch"
    script.write_text(REQUEUE_SCRIPT.format(python=sys.executable))
    jobs = {}
    for flag in ("--no-requeue", "--requeue"):
        log = tmp_path / f"{flag}.log"
        result = slurm_cluster.run(["sbatch", "--parsable", flag, f"--output={log}", str(script)], cwd=ROOT)
        assert result.returncode == 0, result.stderr
        jobs[flag] = (result.stdout.strip().split(";")[0], log)
    try:
        job, log = jobs["--no-requeue"]
        slurm_cluster.wait_for_job(job, lambda fields: "requeued" in (log.read_text() if log.exists() else ""))
        output = log.read_text()
        assert "name slurm requeues False restarts 0" in output and "requeued False" in output
        assert "is not requeueable (submit it with sbatch --requeue)" in output
        job, log = jobs["--requeue"]
        # Slurm ends the running job and queues it again (Restarts=1), to start after BeginTime.
        fields = slurm_cluster.wait_for_job(
            job, lambda fields: fields.get("Restarts") == "1" and fields.get("JobState") in ("PENDING", "REQUEUED")
        )
        assert fields["Requeue"] == "1", fields
        assert "name slurm requeues True restarts 0" in log.read_text()
    finally:
        slurm_cluster.run(["scancel", *(job for job, _ in jobs.values())], timeout=10)


RESUME_SCRIPT = os.path.join(ROOT, "tests", "resume_script.py")
PREEMPTIBLE_JOB = """#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --requeue
#SBATCH --open-mode=append
echo "attempt restart_count=${{SLURM_RESTART_COUNT:-0}}"
srun {python} {script} {out} --backend ddp --step-sleep 0.05
"""


@pytest.mark.slow
def test_usr1_saves_requeues_and_the_requeued_job_ends_like_an_uninterrupted_run(slurm_cluster, tmp_path):  # noqa: F811
    reference = str(tmp_path / "reference")
    result = slurm_cluster.run(["srun", "--ntasks=2", sys.executable, RESUME_SCRIPT, reference, "--backend", "ddp"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr

    out, log = str(tmp_path / "preempted"), tmp_path / "job.log"
    script = tmp_path / "preemptible.sbatch"
    script.write_text(PREEMPTIBLE_JOB.format(python=sys.executable, script=RESUME_SCRIPT, out=out))
    submitted = slurm_cluster.run(
        ["sbatch", "--parsable", f"--output={log}", str(script)], cwd=ROOT, env={"OMP_NUM_THREADS": "1"}
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        slurm_cluster.wait_for_job(job, lambda fields: "STEP 3" in (log.read_text() if log.exists() else ""), timeout=90)
        assert slurm_cluster.run(["scancel", "--signal=USR1", job], timeout=10).returncode == 0
        # Rank 0 saves, then requeues: Slurm queues the job again with a BeginTime; start it sooner.
        # Not in the second of the kill: slurmd refuses a credential made in the second it revoked
        # the job's last one ("Job N already killed, do not launch batch job"), so the job fails.
        slurm_cluster.wait_for_job(job, lambda fields: fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING")
        slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], timeout=10)
        fields = slurm_cluster.wait_for_job(job, lambda fields: fields.get("JobState") in ("COMPLETED", "FAILED"), timeout=120)
    finally:
        slurm_cluster.run(["scancel", job], timeout=10)
    output = log.read_text()
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{output}\n{slurm_cluster.logs()}"
    assert "SIGUSR1 received: saving a checkpoint" in output and "requeued the job" in output, output
    assert "attempt restart_count=0" in output and "attempt restart_count=1" in output
    assert "loaded checkpoint" in output and "FINISHED at step" in output
    resumed, expected = torch.load(os.path.join(out, "result.pt")), torch.load(os.path.join(reference, "result.pt"))
    assert resumed["step"] == expected["step"]
    assert (resumed["params"] - expected["params"]).abs().max().item() <= 1e-6
