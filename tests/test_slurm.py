"""On a real one-node Slurm (tests/slurm_cluster.py): srun and sbatch train like torchrun,
several tasks with a single-process backend are refused, and jobs requeue themselves."""

import csv
import os
import subprocess
import sys

import pytest
import torch
from distributed import free_port
from slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "cluster_train.py")


def read_metrics(out):
    with open(os.path.join(out, "metrics.csv")) as handle:
        return [(row["epoch"], row["step"], row["name"], float(row["value"])) for row in csv.DictReader(handle)]


def files_written(out):
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torchrun"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               SCRIPT, out, "ddp"]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cluster=torchrun rank=0 world=2" in result.stdout
    return out


def assert_same_training(out, reference):
    assert torch.allclose(torch.load(os.path.join(out, "weights.pt")), torch.load(os.path.join(reference, "weights.pt")),
                          atol=1e-6, rtol=0)
    assert read_metrics(out) == read_metrics(reference)
    # One run's files: one metrics.csv, one set of checkpoints (not two copies fighting over them).
    assert files_written(out) == files_written(reference)


def test_srun_two_tasks_train_like_torchrun(slurm_cluster, torchrun_reference, tmp_path):  # noqa: F811
    out = str(tmp_path / "srun")
    result = slurm_cluster.run(["srun", "--ntasks=2", sys.executable, SCRIPT, out, "ddp"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr + slurm_cluster.logs()
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("cluster=")) == [
        "cluster=slurm rank=0 world=2", "cluster=slurm rank=1 world=2"]
    assert_same_training(out, torchrun_reference)


def test_sbatch_two_tasks_train_like_torchrun(slurm_cluster, torchrun_reference, tmp_path):  # noqa: F811
    out = str(tmp_path / "sbatch")
    script = tmp_path / "train.sbatch"
    # The batch script itself is one process; srun inside it starts the 2 tasks.
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\nsrun {sys.executable} {SCRIPT} {out} ddp\n")
    log = tmp_path / "job.log"
    job = slurm_cluster.sbatch_and_wait([f"--output={log}", str(script)], cwd=ROOT)
    output = log.read_text() if log.exists() else ""
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}\n{slurm_cluster.logs()}"
    assert "cluster=slurm rank=0 world=2" in output and "cluster=slurm rank=1 world=2" in output
    assert_same_training(out, torchrun_reference)


def test_several_tasks_with_a_single_process_backend_stop_before_training(slurm_cluster, tmp_path):  # noqa: F811
    out = str(tmp_path / "sp")
    result = slurm_cluster.run(["srun", "--ntasks=2", sys.executable, SCRIPT, out, "sp"], cwd=ROOT)
    assert result.returncode != 0
    assert "rank 1 of 2 processes started by srun, but the backend runs a single process" in result.stderr
    assert "--backend ddp" in result.stderr and "srun --ntasks=1" in result.stderr
    assert not os.path.exists(out)  # stopped before anything was written


BATCH_SHELL_SCRIPT = """#!/bin/bash
{python} -c '
import logging
from backends import build_backend
logging.basicConfig()
for name in ("sp", "ddp"):
    backend = build_backend(name)
    backend.setup(use_gpu=False)
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
