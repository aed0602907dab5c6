"""The MPI cluster environment: processes started by ``mpirun``/``mpiexec``."""

import logging
import zlib
from typing import Mapping, Optional

from backends.environments.cluster_environment import DEFAULT_PORT, ClusterEnvironment, _int, _port

logger = logging.getLogger(__name__)


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
