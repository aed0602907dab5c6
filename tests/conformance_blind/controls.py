"""Correct controls the kit has no built-in name for; some blind faults derive from them.

- ``blind-ctl-sp-amp-scaled``: ``sp-amp`` with a ``GradScaler`` on CPU (``MixedPrecision(
  use_grad_scaler=True)``, bf16 autocast with dynamic loss scaling): the GradScaler faults need one.
- ``blind-ctl-hsdp``: ``fsdp`` as HSDP: two replica groups when the world size is even (at 2 ranks a
  ``("dp_replicate", "dp_shard")`` mesh of 2 x 1), plain ``fsdp`` on one rank.
"""

from typing import Any, Optional

from backends import FSDP, FullPrecision, MixedPrecision, SingleProcess, TrainerBackend
from backends.options import option
from tests.conformance_blind import control


def scaled_amp(args: Any = None) -> MixedPrecision:
    """bf16 autocast with a GradScaler (what ``sp-amp`` is on CUDA in fp16, on CPU)."""
    return MixedPrecision(dtype=option(args, "amp_dtype"), use_grad_scaler=True)


class HybridFSDP(FSDP):
    """FSDP with two replica groups (HSDP) whenever the world size is even; correct."""

    def setup(self) -> None:
        super().setup()
        if self.world_size > 1 and self.world_size % 2 == 0:
            self.data_parallel_replicate_size = 2


def hsdp_backend(args: Optional[Any] = None, strategy: type = HybridFSDP) -> TrainerBackend:
    return TrainerBackend(strategy.from_arguments(args), FullPrecision())


control(
    "blind-ctl-sp-amp-scaled",
    lambda args: TrainerBackend(SingleProcess.from_arguments(args), scaled_amp(args)),
    "sp-amp with a GradScaler on CPU (MixedPrecision(use_grad_scaler=True))",
)
control("blind-ctl-hsdp", hsdp_backend, "fsdp as HSDP: 2 replica groups at an even world size (2 x 1 at 2 ranks)")
