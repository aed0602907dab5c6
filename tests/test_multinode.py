"""Many machines (docs/many-machines.md), on one host: two Slurm nodes in network namespaces
(``TwoNodeSlurmCluster`` in tests/slurm_cluster.py) and two torchrun agents with c10d
rendezvous run the same program (tests/multinode_script.py) as one torchrun on one node, and
end with the same weights, for ddp (bitwise) and fsdp; a requeued two-node job resumes
bitwise; node-local directories are refused before step 1 on every rank, and a resume from
a node-local ``load_dir`` stops on every rank instead of entering different collectives."""

import os
import re
import subprocess
import sys
import uuid

import pytest
import torch

from distributed import free_port
from slurm_cluster import namespaces_unavailable, two_node_slurm_cluster  # noqa: F401 (the fixture)

from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments
from framework.checkpoint.default import checkpoint_name

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "multinode_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
TIMEOUT = 180
RANK_LINE = re.compile(r"RANK (\d+) LOCAL (\d+) NODE (\d+) WORLD (\d+) HOST (\S+) LAUNCHER (\S+) START (\d+)")
# Each agent (as each node) sees its own directory at a shared path: a bind mount in its own mount namespace.
OWN_DISK = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'


def ranks(output):
    """``{global rank: (local rank, node rank, world size, host, launcher, start step)}`` from the RANK lines."""
    found = {}
    for match in RANK_LINE.finditer(output):
        rank, local, node, world, host, launcher, start = match.groups()
        found[int(rank)] = (int(local), int(node), int(world), host, launcher, int(start))
    return found


def final_weights(out):
    """The module weights of the newest checkpoint in ``out/checkpoints`` (a file or a directory of shards)."""
    directory = os.path.join(out, "checkpoints")
    names = [name for name in os.listdir(directory) if re.fullmatch(r"checkpoint-\d+(\.pt)?", name)]
    newest = max(names, key=lambda name: int(re.findall(r"\d+", name)[0]))
    return DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory)).read(os.path.join(directory, newest))


def assert_same_weights(out, reference, exact):
    checkpoint, expected = final_weights(out), final_weights(reference)
    assert checkpoint.global_step == expected.global_step == 8
    weights, expected_weights = checkpoint.module_state["model"], expected.module_state["model"]
    assert weights.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        if exact:
            assert torch.equal(weights[name], value), name
        else:
            assert torch.allclose(weights[name], value, atol=1e-6, rtol=1e-5), name


def one_node(out, backend):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    result = subprocess.run(
        [*command, SCRIPT, out, "--backend", backend], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def two_agents(out, backend, disks=None):
    """Two torchrun agents (one process each) meeting at a c10d rendezvous on 127.0.0.1; with
    ``disks``, agent ``i`` sees ``disks[i]`` at ``out``'s parent. ``[(returncode, output)]``."""
    port, rendezvous = free_port(), uuid.uuid4().hex[:8]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
    agent += [f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rendezvous}", SCRIPT, out, "--backend", backend]
    processes = []
    for node in range(2):
        own_disk = ["unshare", "--mount", "--propagation", "private", "sh", "-c", OWN_DISK, "sh"]
        prefix = [] if disks is None else [*own_disk, disks[node], os.path.dirname(out)]
        processes.append(
            subprocess.Popen([*prefix, *agent], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    return [(process.returncode, output) for process, output in zip(processes, outputs)]


def srun(cluster, out, backend, *extra):
    command = ["srun", "--nodes=2", "--ntasks=2", sys.executable, SCRIPT, out, "--backend", backend, *extra]
    return cluster.run(command, cwd=ROOT, env={"OMP_NUM_THREADS": "1"}, timeout=TIMEOUT)


def files_under(directory):
    return sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, fs in os.walk(directory) for f in fs)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One torchrun with 2 processes on one node, per backend: ``{backend: output_dir}``."""
    found = {}
    for backend in ("ddp", "fsdp"):
        out = str(tmp_path_factory.mktemp(f"one-node-{backend}"))
        output = one_node(out, backend)
        host = os.uname().nodename
        assert ranks(output) == {0: (0, 0, 2, host, "torchrun", 0), 1: (1, 0, 2, host, "torchrun", 0)}
        found[backend] = out
    return found


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_two_torchrun_agents_train_like_one_node(references, backend, tmp_path):
    out = str(tmp_path / "agents")
    (code_a, output_a), (code_b, output_b) = two_agents(out, backend)
    assert code_a == code_b == 0, output_a + output_b
    seen = ranks(output_a + output_b)
    # c10d rendezvous: which agent is node 0 (rank 0) is not fixed (torchrun ignores --node_rank).
    assert sorted(seen) == [0, 1] and {seen[rank][:3] for rank in seen} == {(0, 0, 2), (0, 1, 2)}
    assert all(seen[rank][1] == rank for rank in seen), seen  # one process per node: the node rank is the rank
    assert (output_a + output_b).count("FINISHED at step 8") == 1
    assert_same_weights(out, references[backend], exact=backend == "ddp")


@pytest.mark.slurm
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_srun_on_two_nodes_trains_like_one_node(two_node_slurm_cluster, references, backend, tmp_path):  # noqa: F811
    out = str(tmp_path / "srun")
    result = srun(two_node_slurm_cluster, out, backend)
    assert result.returncode == 0, result.stdout + result.stderr + two_node_slurm_cluster.logs()
    assert ranks(result.stdout) == {0: (0, 0, 2, "node1", "slurm", 0), 1: (0, 1, 2, "node2", "slurm", 0)}
    assert result.stdout.count("FINISHED at step 8") == 1
    assert_same_weights(out, references[backend], exact=backend == "ddp")


REQUEUED_JOB = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
echo "attempt restart_count=${{SLURM_RESTART_COUNT:-0}} on $(hostname)"
srun {python} {script} {out} --backend {backend} --signal-at 4
"""


@pytest.mark.slurm
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_a_requeued_two_node_job_resumes_exactly(two_node_slurm_cluster, references, backend, tmp_path):  # noqa: F811
    cluster = two_node_slurm_cluster
    out, log, script = str(tmp_path / "requeued"), tmp_path / "job.log", tmp_path / "job.sbatch"
    script.write_text(REQUEUED_JOB.format(python=sys.executable, script=SCRIPT, out=out, backend=backend))
    submitted = cluster.run(["sbatch", "--parsable", f"--output={log}", str(script)], cwd=ROOT, env={"OMP_NUM_THREADS": "1"})
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        # Every rank signals itself after step 4 (as Slurm's --signal does); they save, rank 0
        # requeues: Slurm queues the job again with a BeginTime; start it sooner.
        cluster.wait_for_job(job, lambda fields: fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING", 120)
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], timeout=10)
        fields = cluster.wait_for_job(job, lambda fields: fields.get("JobState") in ("COMPLETED", "FAILED"), timeout=120)
    finally:
        cluster.run(["scancel", job], timeout=10)
    output = log.read_text()
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{output}\n{cluster.logs()}"
    assert "attempt restart_count=0 on node1" in output and "attempt restart_count=1 on node1" in output
    assert "requeued the job" in output, output
    attempts = output.split("attempt restart_count=1")
    assert {rank: seen[3:5] for rank, seen in ranks(attempts[0]).items()} == {0: ("node1", "slurm"), 1: ("node2", "slurm")}
    resumed = ranks(attempts[1])
    start = resumed[0][5]
    assert sorted(resumed) == [0, 1] and resumed[1][5] == start >= 4, output  # both resumed where they stopped
    suffix = ".pt" if backend == "ddp" else ""  # fsdp: a directory of shards
    assert f"loaded checkpoint file://{out}/checkpoints/{checkpoint_name(start, suffix)}" in attempts[1]
    assert output.count("FINISHED at step 8") == 1
    assert_same_weights(out, references[backend], exact=backend == "ddp")  # ddp: bitwise


def assert_refused_before_step_1(output, directory, disks):
    assert "is not the same storage on every node" in output and repr(directory) in output, output
    assert "shared filesystem" in output and "fsspec URL" in output
    assert "rank 1 (host" in output and "it is not there" in output
    assert output.count("StorageNotShared") >= 2, output  # both ranks stop (neither waits in a collective)
    assert not RANK_LINE.search(output)  # no rank began training
    for disk in disks:
        assert files_under(disk) == []  # nothing written, on either node (the token file removed)


@pytest.mark.slurm
def test_node_local_output_dir_is_refused_on_two_slurm_nodes(two_node_slurm_cluster):  # noqa: F811
    cluster = two_node_slurm_cluster
    out = os.path.join(cluster.local_dir, "fsdp-run")
    result = srun(cluster, out, "fsdp")
    assert result.returncode != 0
    assert_refused_before_step_1(result.stdout + result.stderr, out, [cluster.node_disk(node) for node in cluster.nodes])


def test_node_local_output_dir_is_refused_on_two_torchrun_agents(tmp_path):
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    disks = [str(tmp_path / "disk0"), str(tmp_path / "disk1")]
    for disk in [*disks, str(tmp_path / "local")]:
        os.makedirs(disk)
    out = str(tmp_path / "local" / "run")
    results = two_agents(out, "ddp", disks=disks)
    assert all(code != 0 for code, _ in results)
    assert_refused_before_step_1("".join(output for _, output in results), out, disks)


@pytest.mark.slurm
def test_resume_from_a_node_local_load_dir_stops_on_every_rank(two_node_slurm_cluster, references, tmp_path):  # noqa: F811
    # node1 holds the one-node run's checkpoints in its local load_dir, node2 nothing there:
    # the ranks would resume from different checkpoints (fsdp: enter different collectives).
    cluster = two_node_slurm_cluster
    load_dir = os.path.join(cluster.local_dir, "pretrained")
    node1_copy = os.path.join(cluster.node_disk("node1"), "pretrained")
    subprocess.run(["cp", "-r", os.path.join(references["fsdp"], "checkpoints"), node1_copy], check=True)
    try:
        result = srun(cluster, str(tmp_path / "fine-tune"), "fsdp", "--load-dir", load_dir)
    finally:
        subprocess.run(["rm", "-rf", node1_copy], check=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"the ranks see different checkpoints in {load_dir}" in output, output
    assert "rank 0 (host node1): checkpoint-000000008, checkpoint-000000006" in output
    assert "rank 1 (host node2): none" in output
    assert not RANK_LINE.search(output)
