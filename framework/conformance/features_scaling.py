"""Scaled precision state: a forced overflow (an inf loss at one step) under a per-step schedule,
uninterrupted and resumed across it. A precision with a GradScaler skips that step, halves its
scale and must report the step as not taken (the schedule does not advance) and checkpoint its
scale; a precision without one stops the run there, as its reference does."""

import contextlib
from typing import Any, Dict

from framework.conformance.checks import AbruptStop, Context, StopAt, barrier, make_args, make_trainer, saving
from framework.conformance.models import full_state
from framework.conformance.registry import register_feature
from framework.conformance.trajectory import Trajectory, observed_path
from framework.metrics.loss_tracker import TrainingDiverged

INF_STEP = 1
"""The step whose loss overflows: before the checkpoint at step 2 that a resume starts from."""


def _run(context: Context, model: str, name: str, stop_at: int = 0) -> Dict[str, Any]:
    """A run with the overflow at :data:`INF_STEP`: its trajectory, its state, the step it diverged at (or None)."""
    checkpoints = saving(context, name)
    trajectory = Trajectory(checkpoints.save_dir)
    callbacks = [trajectory, *([StopAt(stop_at, "abrupt")] if stop_at else [])]
    args = make_args(context, name, checkpointer_args=checkpoints)
    trainer = make_trainer(context, model, args, callbacks, probes=True, inf_at_step=INF_STEP)
    diverged = None
    try:
        with contextlib.suppress(AbruptStop):
            trainer.train()
    except TrainingDiverged as stopped:  # every rank stops at the same step
        diverged = stopped.step
    barrier()
    return {**observed_path(trainer, trajectory), "state": full_state(trainer), "diverged": diverged}


@register_feature(
    "overflow",
    compare=("state", "history"),
    exact=("diverged", "series", "resumed:started"),
    resumed=("resumed", "resumed:history"),
    models=("mlp",),
    quick=True,
)
def overflow(context: Context, model: str) -> Dict[str, Any]:
    """An inf loss at step 1 under a per-step LR schedule (a GradScaler skips the step: loss scale,
    learning rates and weights as the scaled reference's; without one the run stops at that step),
    and the same run stopped at step 5 and resumed from step 4: step by step as the uninterrupted run."""
    whole = _run(context, model, "uninterrupted")
    if whole["diverged"] is not None:  # no scaler: stopped at that step (as the reference), nothing to resume
        nothing: Dict[str, Any] = {"uninterrupted": [], "uninterrupted:history": [], "resumed": [], "resumed:history": []}
        return {**whole, **nothing, "resumed:started": None}
    _run(context, model, "resumed", stop_at=5)
    resumed = _run(context, model, "resumed")
    return {
        **whole,
        "uninterrupted": whole["state"],
        "uninterrupted:history": whole["history"],
        "resumed": resumed.get("state"),
        "resumed:history": resumed.get("history"),
        "resumed:started": resumed.get("started"),
    }
