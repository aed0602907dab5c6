"""Mutants of the precisions: loss scaling, unscaling every optimizer, buffer and complex casts.
One fault each, killed on one process (the reference is the built-in of the same precision)."""

from typing import Any, Dict, Sequence

import torch

from backends import MixedPrecision, SingleProcess, TrueBF16
from framework.conformance.mutants.library import backend, register_mutant
from framework.conformance.references import ScaledAmp


class ScaledAmpNoUnscale(ScaledAmp):
    """Forgets to unscale before clipping: clipping sees gradients 65536 times too large."""

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass


class ScaledAmpUnscalesFirst(ScaledAmp):
    """The GradScaler unscales only ``optimizers[0]``: clipping sees the other optimizers' scaled gradients."""

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().unscale_gradients(list(optimizers)[:1])


class ScaledAmpStepAlwaysTaken(ScaledAmp):
    """Reports every optimizer step as taken, the ones the GradScaler skipped too: per-step schedulers advance on them."""

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        super().step_optimizers(optimizers, closure)
        return True


class ScaledAmpScaleNotSaved(ScaledAmp):
    """Leaves the GradScaler out of the checkpoint: a resumed run starts again from the initial scale."""

    def state_dict(self) -> Dict[str, Any]:
        return {}


class AmpCastsBuffers(MixedPrecision):
    """Autocast that also casts the module's floating buffers to bf16 (autocast leaves them fp32)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        for owner in module.modules():
            for name, buffer in list(owner.named_buffers(recurse=False)):
                if buffer is not None and buffer.is_floating_point():
                    setattr(owner, name, buffer.to(torch.bfloat16))
        return super().convert_module(module)


class BF16CastsComplex(TrueBF16):
    """True bf16 cast with ``Module.to(torch.bfloat16)``: a complex buffer keeps only its real part."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16)


def _register(name: str, precision: type, kills: tuple, control: str) -> None:
    fault = (precision.__doc__ or "").strip().splitlines()[0]
    register_mutant(name, backend(SingleProcess, precision), fault, kills, "precision", control)


# The correct counterpart, sp-scaled-amp, is the kit's reference for scaled precisions (framework.conformance.references).


_register("mutant-sp-scaled-amp-no-unscale", ScaledAmpNoUnscale, (("clipping", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-scaled-amp-unscales-first", ScaledAmpUnscalesFirst, (("clipping", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-scaled-amp-step-always-taken", ScaledAmpStepAlwaysTaken, (("overflow", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-scaled-amp-scale-not-saved", ScaledAmpScaleNotSaved, (("overflow", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-amp-casts-buffers", AmpCastsBuffers, (("automatic", "buffers", 1),), "sp-amp")
_register("mutant-sp-bf16-casts-complex", BF16CastsComplex, (("automatic", "complex", 1),), "sp-bf16")
