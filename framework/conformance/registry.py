"""What the conformance matrix is made of: features and model shapes, each registered by name.

A feature joins the matrix by decorating the function that runs it::

    @register_feature("ema", compare=("state", "averaged"))
    def ema(context, model): ...        # returns observations (plain data) for the judge

and a model shape by decorating its class (a :class:`~framework.conformance.models.KitNet`
subclass)::

    @register_model("batchnorm")
    class WithBatchNorm(KitNet): ...

Backends join by being registered (``backends.register_backend``, entry points): the kit asks
``backends.available_backends()``. Nobody adds a test for a new cell.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Type, TypeVar

Observations = Dict[str, Any]
F = TypeVar("F", bound=Callable[..., Observations])
M = TypeVar("M", bound=type)


@dataclass(frozen=True)
class Feature:
    """One row family of the matrix: a way of training (or evaluating) that every backend must
    compute as ``sp`` does.

    Attributes:
        name: the feature's name (``--features`` takes it).
        run: ``run(context, model)`` trains on one rank and returns observations (plain data).
        compare: observation keys compared with the reference backend's (``sp``, or ``sp`` with
            the same precision) within the cell's tolerance; the ranks must agree bitwise.
        exact: keys that must equal the reference's exactly.
        resumed: keys compared with this backend's own ``"uninterrupted"`` run (resume tolerance).
        models: the zoo models it runs with (None: every registered one).
        quick: in the default (quick) subset of ``python -m framework.conformance``.
        ranks: world sizes it runs on (``(2, 4)``: only where ranks can differ; ``(1, 2, 4)``: every
            size the kit runs; 4 ranks is the slow tier, where HSDP and model-parallel run 2x2 meshes:
            see :mod:`framework.conformance.layouts`).
        description: one line for the docs' table.
        every_backend: the suite's covering design pairs it with every backend (False for a
            feature that costs seconds per process, such as ``compile``: it is paired with each
            of its shapes only).
    """

    name: str
    run: Callable[..., Observations]
    compare: Tuple[str, ...] = ("state",)
    exact: Tuple[str, ...] = ()
    resumed: Tuple[str, ...] = ()
    models: Optional[Tuple[str, ...]] = None
    quick: bool = False
    ranks: Tuple[int, ...] = (1, 2, 4)
    description: str = ""
    every_backend: bool = True


FEATURES: Dict[str, Feature] = {}
"""Every registered feature by name, in registration order."""
MODELS: Dict[str, Type[Any]] = {}
"""Every registered model shape by name (``"mlp"`` first: the one every feature runs with)."""
QUICK_MODELS: Dict[str, bool] = {}

Target = Tuple[str, str]
"""(feature, backend patterns): a cell a shape runs in, on the backends whose names match one of the
``|``-separated ``fnmatch`` patterns (``"model-parallel|fsdp"``)."""
TARGETS: Dict[str, Tuple[Target, ...]] = {}
"""The cells each shape is run in by the suite beside (or, for a targeted shape, instead of) the
covering design: a layout that only some backends can break is run where it matters."""
TARGETED: Dict[str, bool] = {}
"""Shapes outside the covering design: they run only with the features of their targets (on the
targeted backends in the suite; on any backend from the command line)."""


def register_feature(
    name: str,
    *,
    compare: Tuple[str, ...] = ("state",),
    exact: Tuple[str, ...] = (),
    resumed: Tuple[str, ...] = (),
    models: Optional[Tuple[str, ...]] = None,
    quick: bool = False,
    ranks: Tuple[int, ...] = (1, 2, 4),
    every_backend: bool = True,
) -> Callable[[F], F]:
    """Register ``run(context, model) -> observations`` as the feature ``name`` (a decorator).

    Example:
        >>> @register_feature("doc-example", compare=(), exact=("answer",), models=("mlp",))
        ... def answer(context, model):
        ...     return {"answer": 42}
        >>> FEATURES["doc-example"].exact
        ('answer',)
        >>> del FEATURES["doc-example"]
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"feature name must be a non-empty string, got {name!r}")

    def decorator(run: F) -> F:
        if name in FEATURES and FEATURES[name].run is not run:
            raise ValueError(f"conformance feature {name!r} is already registered")
        description = (run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else name
        FEATURES[name] = Feature(name, run, compare, exact, resumed, models, quick, ranks, description, every_backend)
        return run

    return decorator


def register_model(
    name: str, *, quick: bool = False, targets: Tuple[Target, ...] = (), covered: Optional[bool] = None
) -> Callable[[M], M]:
    """Register a model shape (a ``KitNet`` subclass) as ``name`` (a decorator).

    ``targets``: cells (feature, backend patterns) the suite runs the shape in, beyond the covering
    design; ``covered`` (default: no targets) whether the covering design pairs it with every
    feature and backend too. A shape with targets and ``covered=False`` runs only with its
    targets' features.

    Example:
        >>> from framework.conformance.models import KitNet
        >>> @register_model("doc-shape")
        ... class DocShape(KitNet):
        ...     pass
        >>> MODELS["doc-shape"] is DocShape
        True
        >>> del MODELS["doc-shape"]
    """

    def decorator(cls: M) -> M:
        if name in MODELS and MODELS[name] is not cls:
            raise ValueError(f"conformance model {name!r} is already registered")
        unknown = [feature for feature, _ in targets if feature not in FEATURES]
        if unknown:
            raise ValueError(
                f"conformance model {name!r}: targets name unknown feature(s) {unknown}; registered: {list(FEATURES)}"
            )
        MODELS[name] = cls
        QUICK_MODELS[name] = quick
        TARGETS[name] = tuple(targets)
        TARGETED[name] = not (not targets if covered is None else covered)
        return cls

    return decorator


def build_model(name: str, **options: Any) -> Any:
    """A new instance of the zoo model ``name`` with ``options`` (see ``KitNet``)."""
    if name not in MODELS:
        raise ValueError(f"unknown conformance model {name!r}; registered: {', '.join(MODELS)}")
    return MODELS[name](**options)
