"""Mutants of the precisions: loss scaling, unscaling every optimizer, buffer and complex casts.
One fault each, killed on one process (the reference is the built-in of the same precision)."""

from typing import Sequence

import torch

from backends import MixedPrecision, SingleProcess, TrueBF16, register_backend
from framework.conformance.mutants.library import backend, register_mutant


class ScaledAmp(MixedPrecision):
    """bf16 autocast with a GradScaler (loss scaling), unscaled before clipping as it must be (not a mutant)."""

    def __init__(self) -> None:
        super().__init__("bfloat16", use_grad_scaler=True)


class ScaledAmpNoUnscale(ScaledAmp):
    """Forgets to unscale before clipping: clipping sees gradients 65536 times too large."""

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass


class ScaledAmpUnscalesFirst(ScaledAmp):
    """The GradScaler unscales only ``optimizers[0]``: clipping sees the other optimizers' scaled gradients."""

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().unscale_gradients(list(optimizers)[:1])


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


register_backend("sp-scaled-amp", backend(SingleProcess, ScaledAmp), override=True)  # the correct counterpart


_register("mutant-sp-scaled-amp-no-unscale", ScaledAmpNoUnscale, (("clipping", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-scaled-amp-unscales-first", ScaledAmpUnscalesFirst, (("clipping", "mlp", 1),), "sp-scaled-amp")
_register("mutant-sp-amp-casts-buffers", AmpCastsBuffers, (("automatic", "buffers", 1),), "sp-amp")
_register("mutant-sp-bf16-casts-complex", BF16CastsComplex, (("automatic", "complex", 1),), "sp-bf16")
