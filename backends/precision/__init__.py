"""Precision plugins: how the forward runs and how gradients become an update.

Example:
    >>> from backends.precision import MixedPrecision
    >>> MixedPrecision(dtype="bfloat16").dtype
    torch.bfloat16
"""

from backends.precision.precisions import FullPrecision, MixedPrecision, Precision, TrueBF16

__all__ = ["FullPrecision", "MixedPrecision", "Precision", "TrueBF16"]
