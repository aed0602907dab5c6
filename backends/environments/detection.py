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
from typing import Callable, Dict, List, Mapping, Optional, Type, TypeVar, Union

from backends.environments.cluster_environment import DEFAULT_PORT, ClusterEnvironment, LocalEnvironment, TorchrunEnvironment
from backends.environments.mpi import MPIEnvironment
from backends.environments.slurm import SlurmEnvironment
from backends.plugins import register_entry_points

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "framework.cluster_environments"

__all__ = [
    "DEFAULT_PORT",
    "ENTRY_POINT_GROUP",
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


BUILT_IN_ENVIRONMENTS = {
    "torchrun": TorchrunEnvironment,
    "slurm": SlurmEnvironment,
    "mpi": MPIEnvironment,
    "local": LocalEnvironment,
}
"""The built-in cluster environments, in detection order: the one place their names and order are written
(the registry, the docs' list and the tests read it)."""
for _name, _environment in reversed(BUILT_IN_ENVIRONMENTS.items()):  # each registered first: the order above
    register_cluster_environment(_name, _environment)
