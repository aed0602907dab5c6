"""The kit's own reference backends: what a precision that no built-in single-process backend
computes as is compared with.

``sp-scaled-amp`` is bf16 autocast with a GradScaler (the way to exercise loss scaling on a CPU,
where fp16 autocast does not exist): the reference of every precision with a GradScaler, so that
a scaler's skipped steps, halved scales and checkpointed scale are compared with a scaler's.
A backend may name its reference itself (``TrainerBackend.conformance_reference``).
"""

from typing import ClassVar, Optional

from backends import MixedPrecision, SingleProcess, TrainerBackend, register_backend

SCALED_REFERENCE = "sp-scaled-amp"
"""The reference of a precision with a GradScaler."""


class ScaledAmp(MixedPrecision):
    """bf16 autocast with a GradScaler (loss scaling), unscaled before clipping as it must be.

    Example:
        >>> precision = ScaledAmp()
        >>> precision.use_grad_scaler, str(precision.dtype)
        (True, 'torch.bfloat16')
    """

    def __init__(self) -> None:
        super().__init__("bfloat16", use_grad_scaler=True)


class ScaledReference(TrainerBackend):
    """``sp`` with :class:`ScaledAmp`: the kit's reference for scaled precisions (it is its own reference)."""

    conformance_reference: ClassVar[Optional[str]] = SCALED_REFERENCE


register_backend(SCALED_REFERENCE, lambda args: ScaledReference(SingleProcess.from_arguments(args), ScaledAmp()), override=True)
