"""Correct controls the kit has no built-in name for; some blind faults derive from them.

- ``blind-ctl-sp-amp-scaled``: ``sp-amp`` with a ``GradScaler`` on CPU (``MixedPrecision(
  use_grad_scaler=True)``, bf16 autocast with dynamic loss scaling): the GradScaler faults need one.
- ``blind-ctl-hsdp``: ``fsdp`` as HSDP: two replica groups when the world size is even (at 2 ranks a
  ``("dp_replicate", "dp_shard")`` mesh of 2 x 1), plain ``fsdp`` on one rank.
- ``blind-ctl-fsdp-pp``: ``fsdp`` declared as a pipeline plugin (docs/pipeline-parallel.md, "How a
  pipeline plugin is checked"): ``conformance_layouts`` pp 2 at 2 ranks (pp 2 x dp 2 at 4),
  ``conformance_shapes = ("pipeline",)``, manual optimization and ``auto_micro_batch`` declared
  unsupported. The round-2 pipeline faults derive from it.
"""

from typing import Any, ClassVar, Dict, Optional, Tuple

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


class PipelinePlugin(TrainerBackend):
    """A pipeline plugin as docs/pipeline-parallel.md tells one to declare itself to the kit."""

    conformance_layouts: ClassVar[Dict[int, Dict[str, int]]] = {
        2: {"pipeline_parallel_size": 2},
        4: {"pipeline_parallel_size": 2},
    }
    conformance_shapes: ClassVar[Tuple[str, ...]] = ("pipeline",)
    unsupported_features: ClassVar[Dict[str, str]] = {
        "manual": "blind-ctl-fsdp-pp: manual optimization is not supported with pipeline_parallel_size > 1",
        "auto_micro_batch": "blind-ctl-fsdp-pp: gpu_batch_size_limit='auto' is not supported with pipeline_parallel_size > 1",
    }


def pipeline_backend(args: Optional[Any] = None, strategy: type = FSDP) -> TrainerBackend:
    return PipelinePlugin(strategy.from_arguments(args), FullPrecision())


def hsdp_backend(args: Optional[Any] = None, strategy: type = HybridFSDP) -> TrainerBackend:
    return TrainerBackend(strategy.from_arguments(args), FullPrecision())


control(
    "blind-ctl-sp-amp-scaled",
    lambda args: TrainerBackend(SingleProcess.from_arguments(args), scaled_amp(args)),
    "sp-amp with a GradScaler on CPU (MixedPrecision(use_grad_scaler=True))",
)
control("blind-ctl-fsdp-pp", pipeline_backend, "fsdp declared as a pipeline plugin: pp 2 at 2 ranks, pp 2 x dp 2 at 4")
control("blind-ctl-hsdp", hsdp_backend, "fsdp as HSDP: 2 replica groups at an even world size (2 x 1 at 2 ranks)")
