"""Precision: autocast dtype, GradScaler handling (skipped steps, state, unscaling), true bf16 casts.

The GradScaler faults derive from ``blind-ctl-sp-amp-scaled`` (``sp-amp`` with a GradScaler on
CPU: bf16 autocast with dynamic loss scaling), since the built-in CPU ``sp-amp`` has no scaler.
"""

from typing import Any, ContextManager, Dict, Sequence

import torch

from backends import MixedPrecision, SingleProcess, TrainerBackend, TrueBF16
from backends.options import option
from tests.conformance_blind import fault

MODULE = "tests.conformance_blind.faults_precision"


class AutocastFloat16(MixedPrecision):
    def forward_context(self) -> ContextManager:
        return torch.autocast(device_type=self.device_type, dtype=torch.float16)  # slip: "amp means fp16"


class SkippedStepReportedTaken(MixedPrecision):
    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        if self.scaler is None:
            return super().step_optimizers(optimizers, closure)
        for optimizer in optimizers:
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self.scaler.step(optimizer)
        self.scaler.update()
        return True  # slip: a step the scaler skipped (inf/nan) is reported as taken: schedulers advance


class ScalerStateNotSaved(MixedPrecision):
    def state_dict(self) -> Dict[str, Any]:
        return {}  # slip: "the scaler is rebuilt in setup()": its scale and growth tracker are not checkpointed


class ManualUnscale(MixedPrecision):
    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self.scaler is None:
            return
        scale = self.scaler.get_scale()
        for optimizer in optimizers:  # slip: divides by hand, so scaler.step() unscales a second time
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad.div_(scale)


class ParametersOnlyBF16(TrueBF16):
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        for parameter in module.parameters():  # slip: parameters cast, floating buffers left in fp32
            parameter.data = parameter.data.to(torch.bfloat16)
        return module


def sp_with(precision_class: type, scaled: bool = False) -> Any:
    def factory(args: Any = None) -> TrainerBackend:
        if precision_class is ParametersOnlyBF16:
            precision = ParametersOnlyBF16.from_arguments(args)
        else:
            precision = precision_class(dtype=option(args, "amp_dtype"), use_grad_scaler=True if scaled else None)
        return TrainerBackend(SingleProcess.from_arguments(args), precision)

    return factory


fault(
    "blind-sp-amp-autocast-fp16",
    sp_with(AutocastFloat16),
    area="precision",
    slip="forward_context autocasts to float16 whatever dtype was set up (bf16 on CPU)",
    control="sp-amp",
    ranks=1,
    module=MODULE,
    expect="automatic/mlp (1): bitwise against sp-amp; the train_step dtype check",
)
fault(
    "blind-sp-amp-scaled-skip-reported-taken",
    sp_with(SkippedStepReportedTaken, scaled=True),
    area="precision",
    slip="step_optimizers returns True even when the GradScaler skipped the step (schedulers advance)",
    control="blind-ctl-sp-amp-scaled",
    ranks=1,
    module=MODULE,
    expect="nan_stop / a cell with an inf gradient and a per-step scheduler",
)
fault(
    "blind-sp-amp-scaled-state-not-saved",
    sp_with(ScalerStateNotSaved, scaled=True),
    area="precision",
    slip="the precision's state_dict returns {}: the GradScaler's scale and growth tracker are not checkpointed",
    control="blind-ctl-sp-amp-scaled",
    ranks=1,
    module=MODULE,
    expect="resume_kill9/mlp (1) (only if the scale has changed before the stop)",
)
fault(
    "blind-sp-amp-scaled-manual-unscale",
    sp_with(ManualUnscale, scaled=True),
    area="precision",
    slip="unscale_gradients divides the gradients by the scale by hand; scaler.step() then unscales them again",
    control="blind-ctl-sp-amp-scaled",
    ranks=1,
    module=MODULE,
    expect="automatic/mlp (1), clipping/mlp (1)",
)
fault(
    "blind-sp-bf16-params-only",
    sp_with(ParametersOnlyBF16),
    area="precision",
    slip="true bf16 convert_module casts the parameters only: floating buffers (rotary tables, batch norm stats) stay fp32",
    control="sp-bf16",
    ranks=1,
    module=MODULE,
    expect="automatic/buffers (1), automatic/batchnorm (1)",
)
