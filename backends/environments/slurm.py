"""The Slurm cluster environment: ranks of an ``srun`` step, the batch script, requeueing."""

import logging
import subprocess
from typing import Dict, List, Mapping, Optional

from backends.environments.cluster_environment import ClusterEnvironment, _int, _port
from backends.environments.hostlist import first_host
from backends.environments.mpi import MPIEnvironment

logger = logging.getLogger(__name__)


# Step ids at or above this are Slurm's special steps (batch script, extern, interactive).
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0


class SlurmEnvironment(ClusterEnvironment):
    """A Slurm job: tasks of an ``srun`` step, or the batch script of ``sbatch`` (one process).

    In an ``srun`` step (``SLURM_STEP_ID`` set) the ranks come from ``SLURM_PROCID``,
    ``SLURM_NTASKS``, ``SLURM_LOCALID`` and ``SLURM_NODEID``. The batch script itself is one
    process even when the job has several tasks (Slurm sets ``SLURM_NTASKS`` and
    ``SLURM_PROCID=0`` there too), so a plain ``python run.py`` inside ``sbatch`` runs alone.

    Rendezvous: ``MASTER_ADDR`` if set, else the first host of ``SLURM_STEP_NODELIST`` (or
    ``SLURM_JOB_NODELIST``), where Slurm places task 0. ``MASTER_PORT`` if set, else
    ``10000 + 10 * (job id % 2000) + step id % 10``: in 10000-29999, below the kernel's
    ephemeral ports, and different for concurrent steps of one job.

    Example:
        >>> env = SlurmEnvironment({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
        ...                         "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        ...                         "SLURM_JOB_NODELIST": "gpu[07-08]"})
        >>> env.global_rank, env.world_size, env.local_rank, env.master_address, env.master_port
        (3, 4, 1, 'gpu07', 12420)
    """

    launcher = "srun"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        if "SLURM_JOB_ID" not in environ:
            return False
        mpi = MPIEnvironment(environ)
        if MPIEnvironment.detect(environ):
            # mpirun inside an allocation: its processes inherit SLURM_* that describe its daemons
            # (or the batch shell), not the MPI ranks. Trust Slurm only where both agree.
            slurm = cls(environ)
            try:
                return (mpi.world_size, mpi.global_rank) == (slurm.world_size, slurm.global_rank)
            except ValueError:
                return False
        return True

    def validate(self) -> None:
        if not self.environ.get("SLURM_JOB_ID"):
            raise ValueError(
                "cluster environment 'slurm' needs SLURM_JOB_ID, which is not set: this process is not part of a "
                "Slurm job; start it with srun or sbatch, or leave TrainerArguments.cluster at None to detect"
            )
        super().validate()

    @property
    def in_step(self) -> bool:
        """True inside an ``srun`` step; False in the batch script (or an ``salloc`` shell)."""
        step = self.environ.get("SLURM_STEP_ID", self.environ.get("SLURM_STEPID"))
        return step is not None and step.isdigit() and int(step) < _SLURM_SPECIAL_STEPS

    @property
    def job_id(self) -> int:
        """``SLURM_JOB_ID``."""
        return _int(self.environ, "SLURM_JOB_ID")

    @property
    def world_size(self) -> int:
        return _int(self.environ, "SLURM_NTASKS") if self.in_step else 1

    @property
    def global_rank(self) -> int:
        return _int(self.environ, "SLURM_PROCID") if self.in_step else 0

    @property
    def local_rank(self) -> int:
        return _int(self.environ, "SLURM_LOCALID", 0) if self.in_step else 0

    @property
    def node_rank(self) -> int:
        return _int(self.environ, "SLURM_NODEID", 0) if self.in_step else 0

    @property
    def master_address(self) -> str:
        if self.environ.get("MASTER_ADDR"):
            return self.environ["MASTER_ADDR"]
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if self.environ.get(name):
                return first_host(self.environ[name])
        return "127.0.0.1"

    @property
    def master_port(self) -> int:
        if self.environ.get("MASTER_PORT"):
            return _port(self.environ, "MASTER_PORT")
        step = _int(self.environ, "SLURM_STEP_ID", 0) if self.in_step else 0
        return 10000 + 10 * (self.job_id % 2000) + step % 10

    @property
    def restart_count(self) -> int:
        return _int(self.environ, "SLURM_RESTART_COUNT", 0)

    @property
    def requeues(self) -> bool:
        """True when ``scontrol show job`` says the job is a requeueable batch job (asks once)."""
        if not hasattr(self, "_requeues"):
            info = _scontrol_job_fields(self.job_id)
            self._requeues = info.get("Requeue") == "1" and info.get("BatchFlag") == "1"
        return self._requeues

    def requeue(self) -> bool:
        """``scontrol requeue`` this job when it is requeueable; True when Slurm accepted.

        Slurm then ends the job's processes and queues the job again (it starts after the
        ``BeginTime`` Slurm sets, about two minutes on 22.05), with ``SLURM_RESTART_COUNT``
        one higher. Call it from one process only.
        """
        if not self.requeues:
            logger.warning("Slurm job %s is not requeueable (submit it with sbatch --requeue)", self.job_id)
            return False
        result = _run(["scontrol", "requeue", str(self.job_id)])
        if result is None or result.returncode != 0:
            detail = "scontrol did not answer" if result is None else (result.stderr or result.stdout).strip()
            logger.warning("scontrol requeue %s failed: %s", self.job_id, detail)
            return False
        logger.info("Slurm job %s requeued", self.job_id)
        return True

    @property
    def launch_hint(self) -> Optional[str]:
        tasks = _int(self.environ, "SLURM_NTASKS", 1)
        if self.in_step or tasks <= 1:
            return None
        return (
            f"this is the batch script of Slurm job {self.environ['SLURM_JOB_ID']}, which has {tasks} tasks, but it "
            f"runs as one process; start the training with srun (srun python script.py) to use all {tasks} tasks"
        )

    @property
    def one_process_launch(self) -> str:
        return "srun --ntasks=1 python script.py, or python script.py directly in the sbatch script"


def _run(command: List[str], timeout: float = 30.0) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("%s failed: %s", " ".join(command), error)
        return None


def _scontrol_job_fields(job_id: int) -> Dict[str, str]:
    """``scontrol show job --oneliner`` as ``{field: value}`` (empty when scontrol fails)."""
    result = _run(["scontrol", "show", "job", "--oneliner", str(job_id)])
    if result is None or result.returncode != 0:
        return {}
    fields: Dict[str, str] = {}
    for token in result.stdout.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields
