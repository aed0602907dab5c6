"""Backends by name: the built-ins, ``@register_backend`` plugins and entry points."""

import importlib
import inspect
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, Union

from backends.base import TrainerBackend
from backends.options import OPTION_DEFAULTS, BackendArguments, check_backend_options, option
from backends.plugin_options import (
    BackendOption,
    declarations_of,
    declare_options,
    declared_elsewhere,
    record_declarations,
    resolve_options,
)
from backends.plugins import register_entry_points
from backends.precision.precisions import FullPrecision, MixedPrecision, TrueBF16
from backends.strategies.ddp import DDP
from backends.strategies.fsdp import FSDP
from backends.strategies.model_parallel import ModelParallel
from backends.strategies.strategy import SingleProcess

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "framework.backends"

BackendFactory = Callable[..., TrainerBackend]
"""``factory(args)`` returning a backend built from the run's arguments, or ``factory()`` (older plugins)."""
F = TypeVar("F", bound=BackendFactory)

_registry: Dict[str, BackendFactory] = {}
_takes_arguments: Dict[int, bool] = {}  # by id(factory) (registered factories stay alive), decided at registration
_entry_points_loaded = False


def _accepts_arguments(factory: Callable[..., Any], declared: Mapping[str, Any] = {}) -> bool:
    """True when ``factory`` can be called with one positional argument (the run's arguments)
    (and its ``declared`` options as keywords).

    A ``TrainerBackend`` subclass takes them only through an ``__init__`` of its own (the base
    class's first parameter is the strategy, not the arguments).
    """
    if isinstance(factory, type) and getattr(factory, "__init__", None) is TrainerBackend.__init__:
        return False
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: call it as before
        return False
    try:
        signature.bind(None, **dict.fromkeys(declared))
    except TypeError:
        return False
    return True


def _check_takes_options(name: str, factory: Callable[..., Any], takes_arguments: bool, declared: Mapping[str, Any]) -> None:
    """Refuse, at registration, a factory that could not be called with its declared options as keywords."""
    if not declared:
        return
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*([None] if takes_arguments else []), **dict.fromkeys(declared))
    except TypeError as error:
        raise TypeError(
            f"backend {name!r} declares the options {', '.join(declared)}, which its factory receives as keyword "
            f"arguments, but {getattr(factory, '__qualname__', factory)!r} cannot take them ({error}); give it "
            f"parameters named {', '.join(declared)} (or **options)"
        ) from None


def register_backend(
    name: str,
    factory: Optional[F] = None,
    *,
    override: bool = False,
    options: Optional[Mapping[str, Any]] = None,
) -> Union[F, Callable[[F], F]]:
    """Register a backend factory (a ``TrainerBackend`` subclass or a function returning one).

    Use it as a decorator, ``@register_backend("name")``, or call it directly,
    ``register_backend("name", factory)``. A taken name is an error unless ``override=True``.

    The factory receives the run's arguments (``framework.TrainerArguments``, or None for the
    defaults; see :class:`backends.options.BackendArguments`) and passes the options it uses to
    the constructors, e.g. ``lambda args: TrainerBackend(DDP.from_arguments(args),
    MixedPrecision.from_arguments(args))``; a subclass takes them as ``__init__(self, args=None)``.
    Whether it takes them is decided once, here, from its signature: a factory that takes no
    argument (``lambda: ...``, a subclass whose ``__init__`` takes none or is the base class's)
    is still called without one, and a non-default option it cannot receive is logged as a warning.
    :func:`build_backend` then refuses an option the backend does not take (e.g.
    ``find_unused_parameters=True`` for ``sp``) or was built with another value of.

    ``options`` declares the backend's own options, ``{name: BackendOption(default, help)}`` (or
    ``(default, help)``, or a bare default); without it, the factory's ``declared_options``
    attribute is read (a class attribute of an entry-point plugin). A run sets them in
    ``TrainerArguments.backend_options`` (``--trainer.backend_options.NAME VALUE``), ``--help``
    lists them under the backend's name, and the factory receives each one as a keyword
    argument (the run's value, else the default): ``factory(args, bucket_cap_mb=50)``. A name
    the backend does not declare is refused with the closest declared one
    (see :mod:`backends.plugin_options`).

    Example:
        >>> @register_backend("sp-verbose", override=True)
        ... class VerboseBackend(TrainerBackend):
        ...     def __init__(self, args=None):
        ...         super().__init__(SingleProcess.from_arguments(args), FullPrecision())
        >>> "sp-verbose" in available_backends()
        True
        >>> register_backend("sp-plain", lambda: TrainerBackend(), override=True)  # doctest: +ELLIPSIS
        <function ...>
        >>> build_backend("sp-plain")
        TrainerBackend(strategy=SingleProcess, precision=FullPrecision)
        >>> unregister_backend("sp-verbose"), unregister_backend("sp-plain")  # as before the example
        (None, None)
        >>> from types import SimpleNamespace
        >>> from backends import DDP
        >>> register_backend(
        ...     "ddp-buckets",
        ...     lambda args, bucket_cap_mb: TrainerBackend(
        ...         DDP.from_arguments(args).with_wrap_options(bucket_cap_mb=bucket_cap_mb)
        ...     ),
        ...     options={"bucket_cap_mb": (25, "DDP bucket size in MB")},
        ... )  # doctest: +ELLIPSIS
        <function ...>
        >>> build_backend("ddp-buckets", SimpleNamespace(backend_options={"bucket_cap_mb": 50})).strategy.wrap_options
        {'bucket_cap_mb': 50}
        >>> unregister_backend("ddp-buckets")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")

    def decorator(backend_factory: F) -> F:
        if not callable(backend_factory) or (
            isinstance(backend_factory, type) and not issubclass(backend_factory, TrainerBackend)
        ):
            raise TypeError(
                f"backend {name!r} must be a TrainerBackend subclass or a function returning a TrainerBackend, "
                f"got {backend_factory!r}"
            )
        if name in _registry and not override and _registry[name] is not backend_factory:
            raise ValueError(f"backend name {name!r} is already registered; pass override=True to replace it")
        declarations = options if options is not None else getattr(backend_factory, "declared_options", None)
        declared = declare_options(name, declarations, built_in={*OPTION_DEFAULTS, "backend", "backend_options"})
        takes_arguments = _accepts_arguments(backend_factory, declared)
        _check_takes_options(name, backend_factory, takes_arguments, declared)
        if name in _registry:
            _takes_arguments.pop(id(_registry[name]), None)
        _registry[name] = backend_factory
        _takes_arguments[id(backend_factory)] = takes_arguments
        record_declarations(name, backend_factory, declared)
        return backend_factory

    return decorator(factory) if factory is not None else decorator


def unregister_backend(name: str) -> None:
    """Forget the backend ``name`` (a plugin's, or a built-in one).

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.

    Example:
        >>> register_backend("sp-copy", lambda: build_backend("sp"), override=True)  # doctest: +ELLIPSIS
        <function ...>
        >>> unregister_backend("sp-copy")
        >>> "sp-copy" in available_backends()
        False
    """
    if name not in _registry:
        raise ValueError(f"backend {name!r} is not registered; registered backends: {', '.join(sorted(_registry))}")
    _takes_arguments.pop(id(_registry.pop(name)), None)
    record_declarations(name, None, None)


def _load_entry_points(rescan: bool = False) -> None:
    global _entry_points_loaded
    if _entry_points_loaded and not rescan:
        return
    _entry_points_loaded = True
    register_entry_points(ENTRY_POINT_GROUP, _registry, register_backend, "backend", logger, rescan=rescan)


def reload_entry_points() -> None:
    """Look for entry-point plugins again (after installing a package at run time).

    Entry points are otherwise read once, at the first lookup (:func:`build_backend` or
    :func:`available_backends`). Names registered since stay registered.

    Example:
        >>> reload_entry_points()
        >>> "sp" in available_backends()
        True
    """
    importlib.invalidate_caches()
    _load_entry_points(rescan=True)


def available_backends() -> List[str]:
    """Names of every registered backend, built-ins and plugins, sorted.

    Example:
        >>> {"sp", "sp-amp", "ddp", "ddp-amp"} <= set(available_backends())
        True
    """
    _load_entry_points()
    return sorted(_registry)


def declared_options(name: str) -> Dict[str, BackendOption]:
    """The options the backend ``name`` declares (``register_backend(..., options=...)``), by name.

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.

    Example:
        >>> declared_options("ddp")
        {}
    """
    if name not in _registry:
        _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; available backends: {', '.join(available_backends())}")
    return declarations_of(name, _registry[name])


def resolve_backend_options(name: str, given: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The values the backend ``name`` is built with for its declared options: ``given``
    (``TrainerArguments.backend_options``) over the declared defaults.

    Raises:
        ValueError: ``name`` is not registered; or ``given`` names an option ``name`` does not
            declare (with the closest declared one and the backend that declares it, if one
            does) or a value it does not take; every mistake at once, one per line.

    Example:
        >>> resolve_backend_options("sp", {})
        {}
        >>> resolve_backend_options("sp", {"bucket_cap_mb": 50})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend_options.bucket_cap_mb=50 does not apply to backend 'sp': it declares no backend_options
    """
    return resolve_options(name, declared_options(name), given, declared_elsewhere(name, _registry))


def build_backend(name: str, args: Optional[BackendArguments] = None) -> TrainerBackend:
    """A new backend instance for ``name``, built from the run's arguments ``args``.

    ``args`` is ``framework.TrainerArguments`` or any object with the same option attributes
    (:class:`backends.options.BackendArguments`); None builds every option at its default. The
    options the backend declares reach its factory as keyword arguments
    (:func:`resolve_backend_options` of ``args.backend_options``).

    Example:
        >>> build_backend("ddp-amp")
        TrainerBackend(strategy=DDP, precision=MixedPrecision)
        >>> from types import SimpleNamespace
        >>> build_backend("fsdp", SimpleNamespace(reshard_after_forward=False)).options["reshard_after_forward"]
        False

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names), or
            ``args`` sets an option the backend does not take (see
            :func:`backends.options.check_backend_options`), or a ``backend_options`` name it
            does not declare (see :func:`resolve_backend_options`).
    """
    if name not in _registry:  # a built-in or registered name needs no scan of the installed packages
        _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; available backends: {', '.join(available_backends())}")
    factory = _registry[name]
    if id(factory) not in _takes_arguments:  # put in the registry without register_backend (tests)
        _takes_arguments[id(factory)] = _accepts_arguments(factory)
    takes_arguments = _takes_arguments[id(factory)]
    own = resolve_backend_options(name, getattr(args, "backend_options", None) if args is not None else None)
    backend = factory(args, **own) if takes_arguments else factory(**own)
    if not isinstance(backend, TrainerBackend):  # a factory function may return anything
        raise TypeError(f"backend factory for {name!r} returned {type(backend).__name__}, not a TrainerBackend")
    check_backend_options(backend, args, "factory" if takes_arguments else "legacy", name)
    return backend


def _amp(args: Optional[BackendArguments], default_dtype: Optional[str] = None) -> MixedPrecision:
    return MixedPrecision(option(args, "amp_dtype"), default_dtype=default_dtype)


register_backend("sp", lambda args: TrainerBackend(SingleProcess.from_arguments(args), FullPrecision()))
register_backend("sp-amp", lambda args: TrainerBackend(SingleProcess.from_arguments(args), _amp(args)))
register_backend("ddp", lambda args: TrainerBackend(DDP.from_arguments(args), FullPrecision()))
register_backend("ddp-amp", lambda args: TrainerBackend(DDP.from_arguments(args), _amp(args)))
register_backend("fsdp", lambda args: TrainerBackend(FSDP.from_arguments(args), FullPrecision()))
register_backend("fsdp-amp", lambda args: TrainerBackend(FSDP.from_arguments(args), _amp(args, default_dtype="bfloat16")))
register_backend("sp-bf16", lambda args: TrainerBackend(SingleProcess.from_arguments(args), TrueBF16.from_arguments(args)))
register_backend("ddp-bf16", lambda args: TrainerBackend(DDP.from_arguments(args), TrueBF16.from_arguments(args)))
register_backend("fsdp-bf16", lambda args: TrainerBackend(FSDP.from_arguments(args), TrueBF16.from_arguments(args)))
register_backend("model-parallel", lambda args: TrainerBackend(ModelParallel.from_arguments(args), FullPrecision()))
register_backend(
    "model-parallel-amp", lambda args: TrainerBackend(ModelParallel.from_arguments(args), _amp(args, default_dtype="bfloat16"))
)
register_backend(
    "model-parallel-bf16", lambda args: TrainerBackend(ModelParallel.from_arguments(args), TrueBF16.from_arguments(args))
)
