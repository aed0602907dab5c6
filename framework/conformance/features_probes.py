"""Features whose inputs are chosen to break the cancellations that hide faults where a run ends:
sums and extremes where a weighted mean's common factor cancels, a per-step schedule, gradient
clipping by value with the logged pre-clip norm, integer ids past 2^24."""

from typing import Any, Dict

from framework.conformance.checks import Context, make_args, make_trainer
from framework.conformance.models import full_state
from framework.conformance.registry import register_feature
from framework.conformance.trajectory import Trajectory, observed_path


@register_feature("probes", compare=("state", "history", "validated"), exact=("series",), models=("mlp",), quick=True)
def probes(context: Context, model: str) -> Dict[str, Any]:
    """Integer ids past 2^24, a per-step LR schedule, clip_grad_value=0.02 with clip_grads (0.05: both bind)
    and track_grad_norm, metrics reduced by sum, max and min in training and in validation (21
    samples: uneven shares): every step's values, the validated metrics and the weights as sp's."""
    trajectory = Trajectory()
    args = make_args(context, "probes", clip_grads=True, max_grad_norm=0.05, clip_grad_value=0.02, track_grad_norm=True)
    trainer = make_trainer(context, model, args, [trajectory], probes=True)
    trainer.train()
    validated = trainer.validate()
    return {
        **observed_path(trainer, trajectory),
        "state": full_state(trainer),
        "validated": [validated[name] for name in sorted(validated)],
    }
