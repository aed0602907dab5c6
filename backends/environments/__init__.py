"""Cluster environments: where the processes of a run come from (torchrun, Slurm, MPI, yours).

``detection`` holds the registry and the detection order; one module per launcher beside it.

Example:
    >>> from backends.environments import detect_cluster_environment
    >>> detect_cluster_environment({}).world_size
    1
"""

from backends.environments.cluster_environment import DEFAULT_PORT, ClusterEnvironment, LocalEnvironment, TorchrunEnvironment
from backends.environments.detection import (
    available_cluster_environments,
    check_launch,
    detect_cluster_environment,
    register_cluster_environment,
    select_cluster_environment,
    unregister_cluster_environment,
)
from backends.environments.mpi import MPIEnvironment
from backends.environments.slurm import SlurmEnvironment

__all__ = [
    "DEFAULT_PORT",
    "ClusterEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SlurmEnvironment",
    "TorchrunEnvironment",
    "available_cluster_environments",
    "check_launch",
    "detect_cluster_environment",
    "register_cluster_environment",
    "select_cluster_environment",
    "unregister_cluster_environment",
]
