"""Backends with one fault each, as the tests name them: the kit's mutant library
(``framework/conformance/mutants/``) under the short names ``tests/test_conformance.py`` uses.
Importing this module registers them (the kit's ranks import it by name: ``--import conformance_faults``)."""

from backends import FullPrecision, SingleProcess, register_backend
from framework.conformance.mutants.collectives import DroppingNoSync, NoAllReduce, NoBroadcast
from framework.conformance.mutants.library import backend
from framework.conformance.mutants.precision import ScaledAmp, ScaledAmpNoUnscale

__all__ = ["DroppingNoSync", "NoAllReduce", "NoBroadcast", "ScaledAmp", "ScaledAmpNoUnscale"]

register_backend("ddp-no-allreduce", backend(NoAllReduce, FullPrecision), override=True)
register_backend("ddp-no-broadcast", backend(NoBroadcast, FullPrecision), override=True)
register_backend("ddp-dropping-no-sync", backend(DroppingNoSync, FullPrecision), override=True)
register_backend("sp-scaled-amp", backend(SingleProcess, ScaledAmp), override=True)
register_backend("sp-scaled-amp-no-unscale", backend(SingleProcess, ScaledAmpNoUnscale), override=True)
