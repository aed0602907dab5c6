"""The mutant library: faulty strategies and precisions, one fault each, registered as backends
by importing this package (the kit's ranks import it by name: ``--import framework.conformance.mutants``).

``python -m framework.conformance --mutants`` runs, on every mutant, the cells it declares must
kill it (``--all``: the whole quick set) and reports the mutation score. A new promise a backend
makes comes with its mutant here.
"""

from framework.conformance.mutants import (  # noqa: F401
    agreement,
    collectives,
    data,
    layouts,
    meshes,
    pipeline,
    precision,
    probes,
    sharded,
    trajectory,
)
from framework.conformance.mutants.library import MUTANTS, Kill, Mutant, register_mutant
from framework.conformance.mutants.precision import ScaledAmp

__all__ = ["MUTANTS", "Kill", "Mutant", "ScaledAmp", "register_mutant"]
