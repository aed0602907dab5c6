"""The mutant registry: a faulty backend, the one fault it has, and the cells that must kill it.

A mutant is a backend like any plugin (a subclass of a built-in strategy, precision or sampler,
registered with ``backends.register_backend``) plus one line naming its fault and the cells of
the matrix that must fail on it. ``python -m framework.conformance --mutants`` runs those cells
on every mutant and reports the mutation score (killed / all): a mutant that survives is a kit
defect, fixed by a new cell, check or varied input.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from backends import register_backend
from framework.conformance.layouts import LAYOUT_SIZES

Kill = Tuple[str, str, int]
"""(feature, model, ranks): a cell, and the world size it must fail at."""


@dataclass(frozen=True)
class Mutant:
    """A registered faulty backend.

    Attributes:
        name: its backend name (``mutant-...``).
        fault: the fault, in one line.
        kills: the cells that must fail on it, each at a world size.
        kind: the promise it breaks (collectives, broadcasts, data, precision, clipping, state,
            evaluation).
        control: the correct backend it was made from, which must pass the same cells (empty:
            read from the name, ``mutant-<backend>-<fault>``).

    Example:
        >>> Mutant("mutant-x", "forgets x", (("automatic", "mlp", 2),), "data").kills[0]
        ('automatic', 'mlp', 2)
    """

    name: str
    fault: str
    kills: Tuple[Kill, ...]
    kind: str
    control: str = ""


MUTANTS: Dict[str, Mutant] = {}
"""Every registered mutant by backend name, in registration order."""


def register_mutant(
    name: str, factory: Callable[[Any], Any], fault: str, kills: Tuple[Kill, ...], kind: str, control: str = ""
) -> Mutant:
    """Register the backend ``name`` (``factory(args)`` builds it) as a mutant with its ``fault``
    and the ``kills`` cells (feature, model, ranks) that must fail on it.

    Raises:
        ValueError: ``kills`` is empty or names a world size other than 1, 2 or 4.
    """
    if not kills or any(ranks not in LAYOUT_SIZES for _, _, ranks in kills):
        raise ValueError(
            f"mutant {name!r}: kills={kills!r} is invalid; allowed: (feature, model, ranks) cells with ranks one of "
            f"{', '.join(map(str, LAYOUT_SIZES))}, at least one"
        )
    register_backend(name, factory, override=True)
    mutant = Mutant(name, fault, tuple(kills), kind, control)
    MUTANTS[name] = mutant
    return mutant


def backend(strategy: Any, precision: Any) -> Callable[[Any], Any]:
    """A factory building ``TrainerBackend(strategy.from_arguments(args), precision())``."""
    from backends import TrainerBackend

    return lambda args: TrainerBackend(strategy.from_arguments(args), precision())
