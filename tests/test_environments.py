"""Cluster environments from plain variable dicts: hostlists, detection order, registry, launch checks."""

import logging
import re

import pytest

from backends import SingleProcess, TrainerBackend, build_backend
from backends.environments import (
    ClusterEnvironment,
    LocalEnvironment,
    MPIEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    available_cluster_environments,
    check_launch,
    detect_cluster_environment,
    register_cluster_environment,
    select_cluster_environment,
    unregister_cluster_environment,
)
from backends.environments.detection import BUILT_IN_ENVIRONMENTS
from backends.environments.hostlist import expand_hostlist, first_host
from framework import TrainerArguments
from framework.config.cli import parse_config

# What the real Slurm 22.05 sets (recorded on the test cluster): task 1 of `srun -n 2`,
# and the batch script of `sbatch -n 2` (no SLURM_STEP_ID there).
SRUN_TASK_1 = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOBID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_TASKS": "2",
}
SBATCH_SHELL = {
    "SLURM_JOB_ID": "1235",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_GTIDS": "0",
}
TORCHRUN_WORKER = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none",
}


@pytest.mark.parametrize(
    "expression, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1-2]-ib,login", ["n1-ib", "n2-ib", "login"]),
        ("host-a.example.com,host-b", ["host-a.example.com", "host-b"]),
    ],
)
def test_hostlist_expansion(expression, hosts):
    assert expand_hostlist(expression) == hosts
    assert first_host(expression) == hosts[0]


@pytest.mark.parametrize("expression", ["", "node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "a,,b", "n[[1]]"])
def test_bad_hostlists_are_errors_naming_the_expression(expression):
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(expression)


def test_built_in_detection_order():
    assert available_cluster_environments() == list(BUILT_IN_ENVIRONMENTS)


def test_srun_task_is_slurm_with_its_ranks_and_a_job_derived_port():
    environment = detect_cluster_environment(SRUN_TASK_1)
    assert isinstance(environment, SlurmEnvironment)
    assert (environment.world_size, environment.global_rank, environment.local_rank, environment.node_rank) == (2, 1, 1, 0)
    assert environment.master_address == "vm"
    assert environment.master_port == 10000 + 10 * (1234 % 2000)
    assert 10000 <= environment.master_port < 30000
    step_1 = SlurmEnvironment(dict(SRUN_TASK_1, SLURM_STEP_ID="1"))
    assert step_1.master_port == environment.master_port + 1  # concurrent steps of one job differ


def test_slurm_rendezvous_is_the_first_host_of_the_step_and_master_variables_win():
    environment = SlurmEnvironment(dict(SRUN_TASK_1, SLURM_JOB_NODELIST="gpu[03-04,07]", SLURM_STEP_NODELIST="gpu[04,07]"))
    assert environment.master_address == "gpu04"
    without_step_list = {k: v for k, v in SRUN_TASK_1.items() if k != "SLURM_STEP_NODELIST"}
    assert SlurmEnvironment(dict(without_step_list, SLURM_JOB_NODELIST="a[1-2],b3")).master_address == "a1"
    forced = SlurmEnvironment(dict(SRUN_TASK_1, MASTER_ADDR="10.0.0.5", MASTER_PORT="23456"))
    assert (forced.master_address, forced.master_port) == ("10.0.0.5", 23456)


def test_sbatch_shell_is_one_process_even_with_several_tasks():
    environment = detect_cluster_environment(SBATCH_SHELL)
    assert environment.name == "slurm" and environment.world_size == 1 and environment.global_rank == 0
    check_launch(environment, multi_process=False)  # plain `python run.py` in an sbatch script runs
    assert "srun" in environment.launch_hint


def test_torchrun_variables_win_over_slurm_ones():
    # `srun` starting one torchrun per node: workers inherit the SLURM_* of the srun task.
    environment = detect_cluster_environment({**SRUN_TASK_1, **TORCHRUN_WORKER})
    assert isinstance(environment, TorchrunEnvironment)
    assert (environment.global_rank, environment.world_size, environment.local_rank, environment.node_rank) == (3, 4, 1, 1)
    assert environment.restarts_failed_processes and environment.launcher_store and environment.restart_count == 0


def test_srun_with_pmi2_is_slurm_and_mpirun_inside_an_allocation_is_mpi():
    pmi2 = dict(SRUN_TASK_1, PMI_RANK="1", PMI_SIZE="2", PMI_FD="13", PMI_JOBID="1234.0")
    assert detect_cluster_environment(pmi2).name == "slurm"
    # Open MPI's mpirun from the batch shell: 4 ranks whose SLURM_* are the batch shell's.
    mpirun = dict(
        SBATCH_SHELL,
        OMPI_COMM_WORLD_RANK="2",
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_RANK="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
    )
    environment = detect_cluster_environment(mpirun)
    assert environment.name == "mpi" and (environment.global_rank, environment.world_size) == (2, 4)
    # ... and on its per-node daemon step (SLURM_PROCID is the node index there).
    daemons = dict(SRUN_TASK_1, SLURM_PROCID="0", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4")
    assert detect_cluster_environment(daemons).name == "mpi"


def test_mpi_environments():
    open_mpi = MPIEnvironment(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "MASTER_ADDR": "n0",
        }
    )
    assert (open_mpi.global_rank, open_mpi.local_rank, open_mpi.node_rank, open_mpi.master_address) == (5, 1, 1, "n0")
    pmi = detect_cluster_environment(
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_JOBID": "77"}
    )
    assert pmi.name == "mpi" and (pmi.global_rank, pmi.world_size, pmi.local_rank, pmi.master_address) == (1, 2, 1, "127.0.0.1")
    assert 10000 <= pmi.master_port < 30000
    spanning = MPIEnvironment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _ = spanning.master_address


def test_no_launcher_is_local_one_process():
    environment = detect_cluster_environment({"HOME": "/root"})
    assert isinstance(environment, LocalEnvironment)
    assert (environment.world_size, environment.global_rank, environment.requeue(), environment.requeues) == (1, 0, False, False)


def test_torchrun_without_rendezvous_names_the_missing_variables():
    environment = TorchrunEnvironment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but MASTER_ADDR not set; launch with torchrun"):
        _ = environment.master_address


def test_bad_variables_are_clear_errors():
    with pytest.raises(ValueError, match=r"SLURM_PROCID='x' is invalid"):
        select_cluster_environment(None, dict(SRUN_TASK_1, SLURM_PROCID="x"))
    with pytest.raises(ValueError, match="reports rank 5, local rank 1 and world size 2"):
        select_cluster_environment(None, dict(SRUN_TASK_1, SLURM_PROCID="5"))
    with pytest.raises(ValueError, match="needs SLURM_JOB_ID, which is not set: this process is not part of a Slurm job"):
        select_cluster_environment("slurm", {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    with pytest.raises(ValueError, match="environment variable RANK is not set"):
        select_cluster_environment("torchrun", {"WORLD_SIZE": "2"})


def test_a_name_forces_an_environment_and_an_unknown_name_lists_the_known_ones():
    assert select_cluster_environment("local", SRUN_TASK_1).world_size == 1
    assert select_cluster_environment("slurm", {**SRUN_TASK_1, **TORCHRUN_WORKER}).world_size == 2
    with pytest.raises(ValueError, match="unknown cluster environment 'k8s'; available: torchrun, slurm, mpi, local"):
        select_cluster_environment("k8s", {})
    with pytest.raises(ValueError, match=re.escape("TrainerArguments.cluster=''")):
        TrainerArguments(cluster="")
    assert parse_config(argv=["--trainer.cluster", "slurm"]).trainer.cluster == "slurm"


class _ToyScheduler(ClusterEnvironment):
    @classmethod
    def detect(cls, environ):
        return "TOY_RANK" in environ

    @property
    def world_size(self):
        return int(self.environ["TOY_SIZE"])

    @property
    def global_rank(self):
        return int(self.environ["TOY_RANK"])


def test_registered_environment_is_detected_first_or_before_a_given_name():
    try:
        register_cluster_environment("toy", _ToyScheduler)
        assert available_cluster_environments()[0] == "toy"
        environment = detect_cluster_environment({**TORCHRUN_WORKER, "TOY_RANK": "1", "TOY_SIZE": "3"})
        assert environment.name == "toy" and environment.world_size == 3
        with pytest.raises(ValueError, match="already registered"):
            register_cluster_environment("toy", LocalEnvironment)
        register_cluster_environment("toy", _ToyScheduler, before="local", override=True)
        assert available_cluster_environments() == [*list(BUILT_IN_ENVIRONMENTS)[:-1], "toy", "local"]
        assert detect_cluster_environment({**TORCHRUN_WORKER, "TOY_RANK": "1", "TOY_SIZE": "3"}).name == "torchrun"
        with pytest.raises(ValueError, match="before='lsf' is not a registered"):
            register_cluster_environment("toy2", _ToyScheduler, before="lsf")
        with pytest.raises(TypeError, match="ClusterEnvironment subclass"):
            register_cluster_environment("toy3", object)
    finally:
        unregister_cluster_environment("toy")
    assert available_cluster_environments() == list(BUILT_IN_ENVIRONMENTS)


@pytest.mark.parametrize(
    "variables, launcher",
    [
        (SRUN_TASK_1, "srun"),
        (TORCHRUN_WORKER, "torchrun"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "mpirun"),
    ],
)
def test_several_processes_with_a_single_process_strategy_are_refused(variables, launcher):
    environment = detect_cluster_environment(variables)
    with pytest.raises(ValueError, match=f"started by {launcher}, but the backend runs a single process") as error:
        check_launch(environment, multi_process=False)
    assert "--backend ddp" in str(error.value)
    check_launch(environment, multi_process=True)  # the same launch is fine for DDP
    backend = TrainerBackend(SingleProcess(use_gpu=False, cluster=environment))
    with pytest.raises(ValueError, match="single process"):
        backend.setup()


def test_multi_process_strategy_in_an_sbatch_shell_warns():
    # A handler on the logger itself: after a Trainer ran, backends loggers stop propagating.
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("backends.environments")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # whatever level an earlier Trainer's log_level left on "backends"
    try:
        check_launch(detect_cluster_environment(SBATCH_SHELL), multi_process=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("start the training with srun" in message for message in messages), messages


def test_backend_exposes_the_environment_it_set_up_with():
    backend = build_backend("sp", TrainerArguments(use_gpu=False, cluster="local"))
    backend.setup()
    assert backend.cluster_environment.name == "local" and backend.world_size == 1


def test_the_docs_list_the_built_in_environments_in_detection_order():
    """Fault: a built-in environment added, removed or reordered in the code and not in docs/distributed.md."""
    import os

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "distributed.md")) as handle:
        text = handle.read()
    named = ", ".join(f"`{name}`" for name in BUILT_IN_ENVIRONMENTS)
    assert f"then {named}; the first that claims the process wins" in text
    table = re.findall(r"^\| `(\w+)` \|", text.split("**Detection order**")[0], re.M)
    assert table[-len(BUILT_IN_ENVIRONMENTS) :] == list(BUILT_IN_ENVIRONMENTS)
