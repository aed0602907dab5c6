"""Blind faulty backend plugins for the conformance kit, written from the public contract only.

Each fault is ONE slip a plugin author could make in ONE overridden method of a correct built-in
(strategy, precision, checkpoint IO, sampler), registered with ``register_backend`` as
``blind-<short-name>``. The kit (``python -m framework.conformance``) is used as a black box:
``tests/conformance_blind/score.py`` runs it on every fault and prints the score. See README.md.

This module holds the catalogue (:data:`FAULTS`) and :func:`fault`, which registers a fault and
records its metadata; the fault modules (:data:`MODULES`) register their faults when imported.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from backends import register_backend

MODULES: Tuple[str, ...] = (
    "tests.conformance_blind.controls",
    "tests.conformance_blind.faults_collectives",
    "tests.conformance_blind.faults_data",
    "tests.conformance_blind.faults_precision",
    "tests.conformance_blind.faults_state",
    "tests.conformance_blind.faults_evaluation",
    "tests.conformance_blind.faults_parallel",
    "tests.conformance_blind.faults_clipping",
    "tests.conformance_blind.faults_round2",
)
"""Every module that registers blind faults (or controls) on import, by module name."""


@dataclass(frozen=True)
class Fault:
    """One blind fault: its backend name, area, the slip, its correct control, the world size it
    needs, the module that registers it, and the kit cells a user would expect to catch it."""

    name: str
    area: str
    slip: str
    control: str
    ranks: int
    module: str
    expect: str
    kit_args: Tuple[str, ...] = ()
    """More arguments for the kit (round 2: ``--models pipeline`` for a pipeline plugin)."""


FAULTS: Dict[str, Fault] = {}
"""Blind faults registered so far (by importing :data:`MODULES`), by backend name."""

CONTROLS: Dict[str, str] = {}
"""Correct non-built-in controls registered by :mod:`tests.conformance_blind.controls` (name -> what it is)."""


def fault(
    name: str,
    factory: Callable[..., Any],
    *,
    area: str,
    slip: str,
    control: str,
    ranks: int,
    module: str,
    expect: str,
    kit_args: Tuple[str, ...] = (),
) -> None:
    """Register backend ``name`` (built by ``factory(args)``) and record it as a blind fault.

    ``override=True``: a module may be imported twice (as a file by ``--import path.py`` and by
    module name), which must not fail.
    """
    if not name.startswith(("blind-", "blind2-")):
        raise ValueError(f"blind fault names start with 'blind-' (round 2: 'blind2-'): {name!r}")
    register_backend(name, factory, override=True)
    FAULTS[name] = Fault(name, area, slip, control, ranks, module, expect, tuple(kit_args))


def control(name: str, factory: Callable[..., Any], what: str) -> None:
    """Register a correct control that is not a built-in (e.g. a GradScaler on CPU, HSDP at 2 ranks)."""
    register_backend(name, factory, override=True)
    CONTROLS[name] = what
