"""Backends by name: the built-ins, ``@register_backend`` plugins and entry points."""

import importlib
import logging
from typing import Callable, Dict, List, Optional, TypeVar, Union

from backends.base import TrainerBackend
from backends.fsdp import FSDP
from backends.plugins import register_entry_points
from backends.precision import FullPrecision, MixedPrecision, TrueBF16
from backends.strategies import DDP, SingleProcess

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "framework.backends"

BackendFactory = Callable[[], TrainerBackend]
F = TypeVar("F", bound=BackendFactory)

_registry: Dict[str, BackendFactory] = {}
_entry_points_loaded = False


def register_backend(name: str, factory: Optional[F] = None, *, override: bool = False) -> Union[F, Callable[[F], F]]:
    """Register a backend factory (a ``TrainerBackend`` subclass or a function returning one).

    Use it as a decorator, ``@register_backend("name")``, or call it directly,
    ``register_backend("name", factory)``. A taken name is an error unless ``override=True``.

    Example:
        >>> @register_backend("sp-verbose", override=True)
        ... class VerboseBackend(TrainerBackend):
        ...     pass
        >>> "sp-verbose" in available_backends()
        True
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
        _registry[name] = backend_factory
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
    del _registry[name]


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    register_entry_points(ENTRY_POINT_GROUP, _registry, register_backend, "backend", logger)


def reload_entry_points() -> None:
    """Look for entry-point plugins again (after installing a package at run time).

    Entry points are otherwise read once, at the first lookup (:func:`build_backend` or
    :func:`available_backends`). Names registered since stay registered.

    Example:
        >>> reload_entry_points()
        >>> "sp" in available_backends()
        True
    """
    global _entry_points_loaded
    importlib.invalidate_caches()
    _entry_points_loaded = False
    _load_entry_points()


def available_backends() -> List[str]:
    """Names of every registered backend, built-ins and plugins, sorted.

    Example:
        >>> {"sp", "sp-amp", "ddp", "ddp-amp"} <= set(available_backends())
        True
    """
    _load_entry_points()
    return sorted(_registry)


def build_backend(name: str) -> TrainerBackend:
    """A new backend instance for ``name``.

    Example:
        >>> build_backend("ddp-amp")
        TrainerBackend(strategy=DDP, precision=MixedPrecision)

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.
    """
    _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; available backends: {', '.join(available_backends())}")
    backend = _registry[name]()
    if not isinstance(backend, TrainerBackend):  # a factory function may return anything
        raise TypeError(f"backend factory for {name!r} returned {type(backend).__name__}, not a TrainerBackend")
    return backend


register_backend("sp", lambda: TrainerBackend(SingleProcess(), FullPrecision()))
register_backend("sp-amp", lambda: TrainerBackend(SingleProcess(), MixedPrecision()))
register_backend("ddp", lambda: TrainerBackend(DDP(), FullPrecision()))
register_backend("ddp-amp", lambda: TrainerBackend(DDP(), MixedPrecision()))
register_backend("fsdp", lambda: TrainerBackend(FSDP(), FullPrecision()))
register_backend("fsdp-amp", lambda: TrainerBackend(FSDP(), MixedPrecision(default_dtype="bfloat16")))
register_backend("sp-bf16", lambda: TrainerBackend(SingleProcess(), TrueBF16()))
register_backend("ddp-bf16", lambda: TrainerBackend(DDP(), TrueBF16()))
register_backend("fsdp-bf16", lambda: TrainerBackend(FSDP(), TrueBF16()))
