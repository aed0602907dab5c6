"""Backend plugins: a backend is a strategy (where steps run) times a precision (how).

Example:
    >>> from backends import build_backend, available_backends
    >>> {"sp", "ddp", "fsdp", "model-parallel"} <= set(available_backends())  # and any installed plugin's
    True
    >>> build_backend("sp")
    TrainerBackend(strategy=SingleProcess, precision=FullPrecision)
"""

from backends import moved_modules
from backends.base import TrainerBackend
from backends.data.batch import map_tensors, move_to_device
from backends.data.samplers import ResumableSampler
from backends.environments.detection import (
    ClusterEnvironment,
    available_cluster_environments,
    detect_cluster_environment,
    register_cluster_environment,
)
from backends.options import BackendArguments, check_backend_options
from backends.plugin_options import BackendOption
from backends.precision.precisions import FullPrecision, MixedPrecision, Precision, TrueBF16
from backends.registry import available_backends, build_backend, register_backend
from backends.strategies.ddp import DDP
from backends.strategies.fsdp import FSDP
from backends.strategies.model_parallel import ModelParallel
from backends.strategies.strategy import SingleProcess, Strategy

moved_modules.install()  # backends.ddp, backends.samplers, ...: the paths before the subpackages

__all__ = [
    "DDP",
    "FSDP",
    "BackendArguments",
    "BackendOption",
    "ClusterEnvironment",
    "FullPrecision",
    "MixedPrecision",
    "ModelParallel",
    "Precision",
    "ResumableSampler",
    "SingleProcess",
    "Strategy",
    "TrainerBackend",
    "TrueBF16",
    "available_backends",
    "available_cluster_environments",
    "build_backend",
    "check_backend_options",
    "detect_cluster_environment",
    "map_tensors",
    "move_to_device",
    "register_backend",
    "register_cluster_environment",
]
