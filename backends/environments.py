"""Cluster environments: where the processes of a run come from (torchrun, Slurm, MPI, yours).

A cluster environment reads its launcher's variables and reports the world size, the
process's ranks, where rank zero serves the rendezvous store, and what the launcher does
when processes fail. Strategies ask the environment; they never read launcher variables.

Detection tries the registered environments in order and takes the first that claims the
process: plugins (unless registered ``before`` a later name), then ``torchrun``, ``slurm``,
``mpi`` and last ``local`` (one process, no launcher), which always claims.

- torchrun first: ``srun`` starting one torchrun per node inside an allocation works, the
  workers' ``RANK``/``WORLD_SIZE`` win over the ``SLURM_*`` they inherit.
- slurm before mpi: ``srun --mpi=pmi2`` sets ``PMI_*`` beside ``SLURM_*`` with the same ranks.
  Slurm steps aside when an MPI launcher's ranks differ from Slurm's (``mpirun`` inside an
  allocation starts its daemons with ``srun``, or its processes from the batch shell).
"""

import logging
import os
import subprocess
import zlib
from typing import Callable, Dict, List, Mapping, Optional, Type, TypeVar, Union

from backends.hostlist import first_host
from backends.plugins import register_entry_points

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "framework.cluster_environments"
DEFAULT_PORT = 29500
"""torch's usual port, used when nothing else gives one."""


class ClusterEnvironment:
    """What the launcher says about this process. Subclass it to support another launcher.

    A subclass overrides :meth:`detect` and the properties its launcher knows; the defaults
    describe one process with no launcher. ``environ`` (default: ``os.environ``) is read
    when a property is asked, so tests can pass plain dicts.

    Args:
        environ: the variables to read (default: the process environment).

    Example:
        >>> class KubernetesEnvironment(ClusterEnvironment):
        ...     @classmethod
        ...     def detect(cls, environ):
        ...         return "MY_JOB_RANK" in environ
        ...     @property
        ...     def world_size(self):
        ...         return int(self.environ["MY_JOB_SIZE"])
        ...     @property
        ...     def global_rank(self):
        ...         return int(self.environ["MY_JOB_RANK"])
        >>> environment = KubernetesEnvironment({"MY_JOB_RANK": "1", "MY_JOB_SIZE": "4"})
        >>> environment.world_size, environment.global_rank, environment.local_rank
        (4, 1, 0)
    """

    name = "local"
    """Set by :func:`register_cluster_environment`; shown in messages."""
    launcher = "python"
    """How users start processes under this environment, for messages (``srun``, ``mpirun``)."""
    detect_before: Optional[str] = None
    """Default place in the detection order when registered: before this name (None: first)."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else dict(environ)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """True when this environment launched the process described by ``environ``."""
        return False

    # -- what every launcher reports ---------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of processes in the run."""
        return 1

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes (0 .. world_size - 1)."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (its GPU index)."""
        return 0

    @property
    def node_rank(self) -> int:
        """Index of this process's node."""
        return 0

    @property
    def master_address(self) -> str:
        """Host of rank zero, which serves the rendezvous store."""
        return self.environ.get("MASTER_ADDR") or "127.0.0.1"

    @property
    def master_port(self) -> int:
        """Port of the rendezvous store on :attr:`master_address`."""
        return _port(self.environ, "MASTER_PORT") if self.environ.get("MASTER_PORT") else DEFAULT_PORT

    # -- what the launcher does on failure ---------------------------------------------
    @property
    def restarts_failed_processes(self) -> bool:
        """True when the launcher restarts the processes after one fails (torchrun --max-restarts)."""
        return False

    @property
    def restart_count(self) -> int:
        """How many times this run was restarted or requeued so far."""
        return 0

    @property
    def requeues(self) -> bool:
        """True when the scheduler can put this job back in its queue (see :meth:`requeue`)."""
        return False

    def requeue(self) -> bool:
        """Ask the scheduler to run this job again later; True when it accepted.

        Call it from one process (global rank zero), after saving a checkpoint: the
        scheduler ends every process of the job. Environments without a queue return False.
        """
        return False

    @property
    def parent_is_launcher(self) -> bool:
        """True when this process's parent is the launcher supervising it (torchrun's agent):
        a process whose parent is gone is orphaned, and stops with a checkpoint
        (``framework/run/launcher_watch.py``)."""
        return False

    # -- rendezvous --------------------------------------------------------------------
    @property
    def launcher_store(self) -> bool:
        """True when the launcher itself serves the store at master address and port and
        keeps it across restarts (torchrun's agent store): processes connect as clients and
        prefix their keys per attempt. False: rank zero creates the store."""
        return False

    # -- messages ----------------------------------------------------------------------
    @property
    def launch_hint(self) -> Optional[str]:
        """A warning for a multi-process strategy when the launch starts fewer processes than
        the user probably meant (an sbatch script with several tasks but no ``srun``)."""
        return None

    @property
    def one_process_launch(self) -> str:
        """How to start this program as one process under this launcher, for messages."""
        return "python script.py"

    def describe(self) -> str:
        """One line: name, ranks and rendezvous address."""
        text = f"{self.name}: rank {self.global_rank} of {self.world_size} (local rank {self.local_rank}, node {self.node_rank})"
        if self.world_size > 1:
            text += f", master {self.master_address}:{self.master_port}"
        return text

    def validate(self) -> None:
        """Read the ranks once, so missing or inconsistent variables fail early and clearly.

        Raises:
            ValueError: a variable is missing or not an integer, or the rank is outside
                ``0 .. world_size - 1``.
        """
        world_size, rank, local_rank = self.world_size, self.global_rank, self.local_rank
        if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
            raise ValueError(
                f"cluster environment {self.name!r} reports rank {rank}, local rank {local_rank} and world size "
                f"{world_size}; allowed: world size >= 1 and 0 <= rank < world size"
            )


class LocalEnvironment(ClusterEnvironment):
    """One process started without a launcher (plain ``python``): the last in detection.

    Example:
        >>> LocalEnvironment({}).describe()
        'local: rank 0 of 1 (local rank 0, node 0)'
    """

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return True


class TorchrunEnvironment(ClusterEnvironment):
    """Processes started by ``torchrun`` (or anything setting torch's ``env://`` variables).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK`` (node), ``MASTER_ADDR``,
    ``MASTER_PORT`` and torchrun's ``TORCHELASTIC_*`` (restarts, agent store).

    Example:
        >>> env = TorchrunEnvironment({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
        ...                            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
        >>> env.global_rank, env.local_rank, env.node_rank, env.master_address, env.master_port
        (3, 1, 1, 'node0', 29500)
    """

    launcher = "torchrun"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return "RANK" in environ and "WORLD_SIZE" in environ

    @property
    def world_size(self) -> int:
        return _int(self.environ, "WORLD_SIZE")

    @property
    def global_rank(self) -> int:
        return _int(self.environ, "RANK")

    @property
    def local_rank(self) -> int:
        return _int(self.environ, "LOCAL_RANK", 0)

    @property
    def node_rank(self) -> int:
        return _int(self.environ, "GROUP_RANK", 0)

    @property
    def master_address(self) -> str:
        self._require_rendezvous()
        return self.environ.get("MASTER_ADDR") or "127.0.0.1"

    @property
    def master_port(self) -> int:
        self._require_rendezvous()
        return _port(self.environ, "MASTER_PORT") if self.environ.get("MASTER_PORT") else DEFAULT_PORT

    @property
    def restarts_failed_processes(self) -> bool:
        return _int(self.environ, "TORCHELASTIC_MAX_RESTARTS", 0) > 0

    @property
    def restart_count(self) -> int:
        return _int(self.environ, "TORCHELASTIC_RESTART_COUNT", 0)

    @property
    def parent_is_launcher(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in self.environ  # a worker of torchrun's agent (not a hand-set RANK)

    @property
    def launcher_store(self) -> bool:
        return self.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in self.environ

    @property
    def one_process_launch(self) -> str:
        return "torchrun --nproc_per_node=1 script.py, or python script.py"

    def _require_rendezvous(self) -> None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not self.environ.get(name)]
        if missing and self.world_size > 1:
            raise ValueError(
                f"WORLD_SIZE={self.world_size} but {' and '.join(missing)} not set; launch with "
                "torchrun (python -m torch.distributed.run), which sets RANK, LOCAL_RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT"
            )


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


class MPIEnvironment(ClusterEnvironment):
    """Processes started by ``mpirun``/``mpiexec``: Open MPI's ``OMPI_COMM_WORLD_*`` or PMI's
    ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI; local rank from ``MPI_LOCALRANKID``).

    MPI has no rendezvous variables: ``MASTER_ADDR`` is needed when ranks span nodes
    (``mpirun -x MASTER_ADDR=host0``); on one node it is 127.0.0.1. ``MASTER_PORT`` if set,
    else a port in 10000-29999 derived from the MPI job id, else 29500.

    Example:
        >>> env = MPIEnvironment({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        ...                       "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
        >>> env.global_rank, env.world_size, env.local_rank, env.master_address
        (1, 2, 1, '127.0.0.1')
    """

    launcher = "mpirun"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ

    @property
    def _open_mpi(self) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in self.environ

    @property
    def world_size(self) -> int:
        return _int(self.environ, "OMPI_COMM_WORLD_SIZE" if self._open_mpi else "PMI_SIZE")

    @property
    def global_rank(self) -> int:
        return _int(self.environ, "OMPI_COMM_WORLD_RANK" if self._open_mpi else "PMI_RANK")

    @property
    def local_rank(self) -> int:
        if self._open_mpi:
            return _int(self.environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        return _int(self.environ, "MPI_LOCALRANKID", self.global_rank)

    @property
    def _local_size(self) -> Optional[int]:
        name = "OMPI_COMM_WORLD_LOCAL_SIZE" if self._open_mpi else "MPI_LOCALNRANKS"
        return _int(self.environ, name) if self.environ.get(name) else None

    @property
    def node_rank(self) -> int:
        local_size = self._local_size
        return self.global_rank // local_size if local_size else 0

    @property
    def master_address(self) -> str:
        if self.environ.get("MASTER_ADDR"):
            return self.environ["MASTER_ADDR"]
        if self.world_size == 1 or self._local_size == self.world_size:
            return "127.0.0.1"
        raise ValueError(
            f"MPI launch of {self.world_size} processes that may span nodes but MASTER_ADDR is not set; "
            "pass the host of rank 0, e.g. mpirun -x MASTER_ADDR=$(hostname) ... (Open MPI) or "
            "mpiexec -genv MASTER_ADDR $(hostname) ... (MPICH)"
        )

    @property
    def master_port(self) -> int:
        if self.environ.get("MASTER_PORT"):
            return _port(self.environ, "MASTER_PORT")
        for name in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID"):
            if self.environ.get(name):
                return 10000 + zlib.crc32(self.environ[name].encode()) % 20000
        return DEFAULT_PORT

    @property
    def one_process_launch(self) -> str:
        return "mpirun -n 1 python script.py, or python script.py"


# -- registry ---------------------------------------------------------------------------

E = TypeVar("E", bound=Type[ClusterEnvironment])
_registry: Dict[str, Type[ClusterEnvironment]] = {}  # in detection order
_entry_points_loaded = False


def register_cluster_environment(
    name: str, environment: Optional[E] = None, *, before: Optional[str] = None, override: bool = False
) -> Union[E, Callable[[E], E]]:
    """Register a :class:`ClusterEnvironment` subclass under ``name``, for detection and for
    ``TrainerArguments(cluster=name)``.

    Use it as a decorator, ``@register_cluster_environment("k8s")``, or call it directly.
    Detection tries it before ``before`` (default: the class's ``detect_before``, else
    first of all, so a plugin's ``detect`` should only claim its own launcher).

    Raises:
        ValueError: the name is taken (without ``override=True``) or ``before`` is unknown.
        TypeError: ``environment`` is not a ClusterEnvironment subclass.

    Example:
        >>> @register_cluster_environment("my-scheduler", before="local", override=True)
        ... class MySchedulerEnvironment(ClusterEnvironment):
        ...     @classmethod
        ...     def detect(cls, environ):
        ...         return "MY_SCHEDULER_RANK" in environ
        >>> available_cluster_environments()[-2:]
        ['my-scheduler', 'local']
        >>> unregister_cluster_environment("my-scheduler")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"cluster environment name must be a non-empty string, got {name!r}")

    def decorator(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, ClusterEnvironment)):
            raise TypeError(f"cluster environment {name!r} must be a ClusterEnvironment subclass, got {cls!r}")
        if name in _registry and not override and _registry[name] is not cls:
            raise ValueError(f"cluster environment {name!r} is already registered; pass override=True to replace it")
        anchor = before if before is not None else cls.detect_before
        if anchor is not None and anchor not in _registry:
            raise ValueError(f"before={anchor!r} is not a registered cluster environment; registered: {', '.join(_registry)}")
        cls.name = name
        entries = [(key, value) for key, value in _registry.items() if key != name]
        position = 0 if anchor is None else [key for key, _ in entries].index(anchor)
        entries.insert(position, (name, cls))
        _registry.clear()
        _registry.update(entries)
        return cls

    return decorator(environment) if environment is not None else decorator


def unregister_cluster_environment(name: str) -> None:
    """Forget the cluster environment ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.
    """
    if name not in _registry:
        raise ValueError(f"cluster environment {name!r} is not registered; registered: {', '.join(_registry)}")
    del _registry[name]


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    register_entry_points(ENTRY_POINT_GROUP, _registry, register_cluster_environment, "cluster environment", logger)


def available_cluster_environments() -> List[str]:
    """Registered names, in detection order.

    Example:
        >>> available_cluster_environments()
        ['torchrun', 'slurm', 'mpi', 'local']
    """
    _load_entry_points()
    return list(_registry)


def detect_cluster_environment(environ: Optional[Mapping[str, str]] = None) -> ClusterEnvironment:
    """The first registered environment that claims this process (``local`` if none does).

    Example:
        >>> detect_cluster_environment({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        ...                             "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}).name
        'slurm'
        >>> detect_cluster_environment({}).name
        'local'
    """
    variables = os.environ if environ is None else environ
    for cls in [_registry[name] for name in available_cluster_environments()]:
        if cls.detect(variables):
            return cls(environ)
    return LocalEnvironment(environ)


def select_cluster_environment(
    cluster: Union[str, ClusterEnvironment, None] = None, environ: Optional[Mapping[str, str]] = None
) -> ClusterEnvironment:
    """The environment named ``cluster`` (or the instance given, or the detected one), validated.

    Raises:
        ValueError: an unknown name (the message lists the known ones), or variables that
            the environment needs are missing or inconsistent.

    Example:
        >>> select_cluster_environment("local").world_size
        1
    """
    if isinstance(cluster, ClusterEnvironment):
        environment = cluster
    elif cluster is None:
        environment = detect_cluster_environment(environ)
    elif isinstance(cluster, str) and cluster in available_cluster_environments():
        environment = _registry[cluster](environ)
    else:
        raise ValueError(
            f"unknown cluster environment {cluster!r}; available: {', '.join(available_cluster_environments())} "
            "(or None to detect it)"
        )
    environment.validate()
    return environment


def check_launch(environment: ClusterEnvironment, multi_process: bool) -> None:
    """The one decision on whether a launch fits the strategy: refuse, warn, or let it run.

    A launch of several processes with a single-process strategy would run N independent
    trainings writing the same files: refused before any step, with how to launch instead.
    A multi-process strategy started as one process where the launcher offered more (the
    batch script of a multi-task Slurm job) gets a warning.

    Raises:
        ValueError: several processes were launched for a single-process strategy.

    Example:
        >>> check_launch(TorchrunEnvironment({"RANK": "0", "WORLD_SIZE": "2"}), multi_process=False)
        Traceback (most recent call last):
        ...
        ValueError: this process is rank 0 of 2 processes started by torchrun, but the backend runs a single process: ...
    """
    if environment.world_size > 1 and not multi_process:
        raise ValueError(
            f"this process is rank {environment.global_rank} of {environment.world_size} processes started by "
            f"{environment.launcher}, but the backend runs a single process: the {environment.world_size} "
            "processes would each train alone and write the same files in output_dir. Either train "
            f"distributed with the same launch and a DDP backend (--backend ddp or ddp-amp; "
            f"TrainerArguments(backend='ddp')), or start one process: {environment.one_process_launch}"
        )
    hint = environment.launch_hint
    if hint and multi_process:
        logger.warning(hint)


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set; the launcher should set it to an integer")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is invalid; allowed: an integer") from None


def _port(environ: Mapping[str, str], name: str) -> int:
    port = _int(environ, name)
    if not 0 < port < 65536:
        raise ValueError(f"environment variable {name}={port} is invalid; allowed: a port in 1-65535")
    return port


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


register_cluster_environment("local", LocalEnvironment)
register_cluster_environment("mpi", MPIEnvironment)
register_cluster_environment("slurm", SlurmEnvironment)
register_cluster_environment("torchrun", TorchrunEnvironment)
