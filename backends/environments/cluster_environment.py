"""The cluster environment interface, and the environments without a scheduler: one local
process, and torchrun's workers (see :mod:`backends.environments.detection` for detection and the registry).
"""

import logging
import os
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

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
        (``framework/lifecycle/launcher_watch.py``)."""
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
