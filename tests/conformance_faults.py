"""Backends with one fault each, as the tests name them: the kit's mutant library
(``framework/conformance/mutants/``) under the short names ``tests/test_conformance.py`` uses.
Importing this module registers them (the kit's ranks import it by name: ``--import conformance_faults``)."""

import os

import torch

from backends import DDP, FullPrecision, SingleProcess, register_backend
from framework.conformance.mutants.collectives import DroppingNoSync, NoAllReduce, NoBroadcast
from framework.conformance.mutants.library import backend
from framework.conformance.mutants.precision import ScaledAmp, ScaledAmpNoUnscale

__all__ = ["AbortsOnBuffers", "DroppingNoSync", "NoAllReduce", "NoBroadcast", "ScaledAmp", "ScaledAmpNoUnscale"]

register_backend("ddp-no-allreduce", backend(NoAllReduce, FullPrecision), override=True)
register_backend("ddp-no-broadcast", backend(NoBroadcast, FullPrecision), override=True)
register_backend("ddp-dropping-no-sync", backend(DroppingNoSync, FullPrecision), override=True)
register_backend("sp-scaled-amp-no-unscale", backend(SingleProcess, ScaledAmpNoUnscale), override=True)


class AbortsOnBuffers(DDP):
    """Rank 1 dies (``os.abort``, as a gloo enforce failure kills it) when it wraps the zoo's buffers model."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.rank == 1 and type(getattr(module, "module", module)).__name__ == "WithBuffers":
            os.abort()
        return super().wrap_module(module)


register_backend("ddp-aborts-on-buffers", backend(AbortsOnBuffers, FullPrecision), override=True)
