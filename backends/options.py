"""Backend options: what a run's arguments may set on a backend's strategy and precision.

Options reach a backend one way, through constructors: a registered factory receives the run's
arguments (``framework.TrainerArguments``, or anything with the same attribute names; see
:class:`BackendArguments`) and passes them to ``DDP(...)``, ``MixedPrecision(...)``. A backend
reports what it was built with (:attr:`backends.TrainerBackend.options`), and
:func:`check_backend_options` refuses an argument that would otherwise be lost: one the
backend does not take, or one it was built with another value of.

backends/ never imports framework/: arguments are read by attribute name, with the defaults below.
"""

import logging
from typing import Any, Dict, Optional, Protocol

from backends.plugin_options import declared_elsewhere, resolve_options

logger = logging.getLogger(__name__)

OPTION_DEFAULTS: Dict[str, Any] = {
    "use_gpu": None,
    "cluster": None,
    "compile": False,
    "find_unused_parameters": False,
    "ddp_timeout": 600.0,
    "reshard_after_forward": True,
    "tensor_parallel_size": None,
    "data_parallel_replicate_size": None,
    "pipeline_parallel_size": 1,
    "pipeline_schedule": "1F1B",
    "amp_dtype": None,
}
"""Every backend option, by its ``TrainerArguments`` name, with the value that means "not set"."""

CONSTRUCTOR_PARAMETERS: Dict[str, str] = {
    "use_gpu": "the strategy's use_gpu=",
    "cluster": "the strategy's cluster=",
    "compile": "the strategy's compile=",
    "find_unused_parameters": "DDP(find_unused_parameters=...)",
    "ddp_timeout": "DDP(timeout_seconds=...) or FSDP(timeout_seconds=...)",
    "reshard_after_forward": "FSDP(reshard_after_forward=...) or ModelParallel(reshard_after_forward=...)",
    "tensor_parallel_size": "ModelParallel(tensor_parallel_size=...)",
    "data_parallel_replicate_size": "FSDP(data_parallel_replicate_size=...) or ModelParallel(data_parallel_replicate_size=...)",
    "pipeline_parallel_size": "FSDP(pipeline_parallel_size=...) or ModelParallel(pipeline_parallel_size=...)",
    "pipeline_schedule": "FSDP(pipeline_schedule=...) or ModelParallel(pipeline_schedule=...)",
    "amp_dtype": "MixedPrecision(dtype=...)",
}
"""Where each option goes when a backend is built by hand."""

APPLIES_TO: Dict[str, str] = {
    "find_unused_parameters": "the ddp backends (ddp, ddp-amp, ddp-bf16)",
    "reshard_after_forward": "the fsdp and model-parallel backends (fsdp*, model-parallel*)",
    "tensor_parallel_size": "the model-parallel backends (model-parallel, model-parallel-amp, model-parallel-bf16)",
    "data_parallel_replicate_size": "the fsdp and model-parallel backends (fsdp*, model-parallel*): HSDP",
    "pipeline_parallel_size": "the fsdp and model-parallel backends (fsdp*, model-parallel*): pipeline parallelism",
    "pipeline_schedule": "the fsdp and model-parallel backends (fsdp*, model-parallel*): pipeline parallelism",
    "amp_dtype": "the mixed-precision backends (*-amp) and, as 'bfloat16', the true bf16 ones (*-bf16)",
    "ddp_timeout": "multi-process strategies (ddp, fsdp)",
}

NO_OP_WITHOUT = frozenset({"ddp_timeout"})
"""Options accepted by every backend although some do not use them: ``ddp_timeout`` bounds how
long a collective waits for another rank, and a single process never waits for one."""


class BackendArguments(Protocol):
    """The run's arguments as a backend factory reads them; ``framework.TrainerArguments`` is one.

    A factory should read them with :func:`option`, which also accepts None (every option at
    its default) and objects that lack some of these attributes.

    Example:
        >>> from types import SimpleNamespace
        >>> option(SimpleNamespace(ddp_timeout=30.0), "ddp_timeout"), option(None, "ddp_timeout")
        (30.0, 600.0)
    """

    use_gpu: Optional[bool]
    cluster: Optional[str]
    compile: bool
    find_unused_parameters: bool
    ddp_timeout: float
    reshard_after_forward: bool
    tensor_parallel_size: Optional[int]
    data_parallel_replicate_size: Optional[int]
    pipeline_parallel_size: int
    pipeline_schedule: str
    amp_dtype: Optional[str]


def option(args: Optional[BackendArguments], name: str) -> Any:
    """The value of the backend option ``name`` in ``args`` (its default when ``args`` is None or lacks it).

    Raises:
        ValueError: ``name`` is not a backend option; the message lists them.

    Example:
        >>> option(None, "reshard_after_forward")
        True
    """
    if name not in OPTION_DEFAULTS:
        raise ValueError(f"unknown backend option {name!r}; allowed: {', '.join(OPTION_DEFAULTS)}")
    return getattr(args, name, OPTION_DEFAULTS[name]) if args is not None else OPTION_DEFAULTS[name]


def set_options(args: Optional[BackendArguments]) -> Dict[str, Any]:
    """The backend options ``args`` sets to a value other than the default.

    Example:
        >>> from types import SimpleNamespace
        >>> set_options(SimpleNamespace(compile=True, use_gpu=None))
        {'compile': True}
    """
    values = {name: option(args, name) for name in OPTION_DEFAULTS}
    return {name: value for name, value in values.items() if value != OPTION_DEFAULTS[name]}


class ReportsOptions(Protocol):
    """What :func:`check_backend_options` reads of a backend (a :class:`~backends.TrainerBackend`)."""

    @property
    def options(self) -> Dict[str, Any]: ...


def check_backend_options(
    backend: ReportsOptions, args: Optional[BackendArguments], built_by: str = "instance", name: Optional[str] = None
) -> None:
    """Refuse a backend option that ``args`` sets but ``backend`` would not use.

    Every option ``args`` sets to a non-default value must be one the backend takes
    (:attr:`~backends.TrainerBackend.options`), with that value. ``built_by`` says where the
    backend came from: ``"instance"`` (``Trainer(trainer_backend=...)``: its constructors' options
    are used), ``"factory"`` (a registered factory that received ``args``) or ``"legacy"`` (a
    zero-argument factory, which cannot receive them: a mismatch is a warning, so such plugins
    keep working). ``ddp_timeout`` is accepted by a backend without collectives (see
    :data:`NO_OP_WITHOUT`).

    Raises:
        ValueError: an option the backend does not take, or was built with another value of;
            the message names the option, the backend and what is allowed.

    Example:
        >>> from types import SimpleNamespace
        >>> from backends import SingleProcess, TrainerBackend
        >>> sp = TrainerBackend(SingleProcess())
        >>> check_backend_options(sp, SimpleNamespace(find_unused_parameters=True))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: find_unused_parameters=True does not apply to the trainer_backend instance ...
    """
    if built_by not in ("instance", "factory", "legacy"):
        raise ValueError(f"built_by={built_by!r} is invalid; allowed: 'instance', 'factory', 'legacy'")
    taken = backend.options
    label = f"backend {name!r}" if name is not None else f"the trainer_backend instance {backend!r}"
    if built_by == "instance":
        _check_no_plugin_options(args, label)
    lost = []
    for option_name, value in set_options(args).items():
        if option_name not in taken:
            if option_name in NO_OP_WITHOUT:
                continue
            if built_by == "legacy":
                lost.append(f"{option_name}={value!r}")
                continue
            raise ValueError(
                f"{option_name}={value!r} does not apply to {label}: it takes {', '.join(taken) or 'no options'}; "
                f"allowed: {option_name}={OPTION_DEFAULTS[option_name]!r} (the option applies to "
                f"{APPLIES_TO.get(option_name, 'other backends')})"
            )
        built = taken[option_name]
        if built == value:
            continue
        if built_by == "legacy":
            lost.append(f"{option_name}={value!r}")
        elif built_by == "instance":
            raise ValueError(
                f"TrainerArguments.{option_name}={value!r}, but {label} was built with {option_name}={built!r}, and an "
                f"instance's own options are used: pass it to {CONSTRUCTOR_PARAMETERS[option_name]} when building the "
                "instance, or choose the backend by name (TrainerArguments.backend) so the arguments reach it"
            )
        else:
            raise ValueError(
                f"{option_name}={value!r} was asked for, but {label}'s factory built it with {option_name}={built!r}; "
                f"the factory must pass args.{option_name} to {CONSTRUCTOR_PARAMETERS[option_name]}"
            )
    if lost:
        logger.warning(
            "backend %r is built by a factory that takes no arguments, so %s from the run's arguments do not reach "
            "it; give the factory an `args` parameter and pass them to the constructors (see docs/backends.md)",
            name,
            ", ".join(lost),
        )


def _check_no_plugin_options(args: Optional[BackendArguments], label: str) -> None:
    """Refuse ``backend_options`` that would not reach an instance: they go to a registered backend's factory."""
    given = getattr(args, "backend_options", None) if args is not None else None
    if not given:
        return
    try:
        resolve_options("", {}, given, declared_elsewhere(None))  # another backend's option at its default: not set
    except ValueError:
        raise ValueError(
            f"TrainerArguments.backend_options={given!r} does not reach {label}: backend_options go to the factory of a "
            "backend chosen by name (TrainerArguments.backend); pass the values to the instance's constructors, or "
            "register the backend and choose it by name"
        ) from None


STRATEGY_OPTIONS = ("use_gpu", "cluster", "compile")
"""The options every strategy's constructor takes (where its processes run, on which device, compiled or not)."""


def strategy_options(args: Optional[BackendArguments]) -> Dict[str, Any]:
    """``use_gpu``, ``cluster`` and ``compile`` from ``args``, as keyword arguments for a strategy's constructor.

    Example:
        >>> strategy_options(None)
        {'use_gpu': None, 'cluster': None, 'compile': False}
    """
    return {name: option(args, name) for name in STRATEGY_OPTIONS}
