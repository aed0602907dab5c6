"""Resume features of the conformance matrix: after an abrupt stop (the in-process stand-in for
``kill -9``), after SIGTERM and SIGUSR1, from a damaged checkpoint, and on another world size."""

import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from framework.conformance.checks import (
    AbruptStop,
    Context,
    SlowRankZeroWrites,
    StopAt,
    barrier,
    described,
    make_args,
    make_trainer,
    run_dir,
    saving,
)
from framework.conformance.models import full_state
from framework.conformance.registry import register_feature
from framework.conformance.trajectory import Trajectory, observed_path
from framework.lifecycle.preemption import TrainingPreempted


def _uninterrupted(context: Context, model: str) -> Dict[str, Any]:
    """The state and the recorded history of a run of the same backend that never stopped."""
    trajectory = Trajectory()
    trainer = make_trainer(context, model, make_args(context, "uninterrupted"), [trajectory])
    trainer.train()
    return {"uninterrupted": full_state(trainer), "uninterrupted:history": observed_path(trainer, trajectory)["history"]}


ENDED = {TrainingPreempted: "preempted", AbruptStop: "abrupt"}
"""How a stopped run ended, by the exception ``train()`` raised (``"finished"``: it returned)."""


def _stopped(
    context: Context,
    model: str,
    name: str,
    how: str,
    step: int = 5,
    skew: int = 0,
    others: Optional[str] = None,
    slow: bool = False,
    **overrides: Any,
) -> Tuple[str, List[List[str]], str]:
    """Train until ``how`` stops the run at ``step`` (``skew``: a step later on each next rank;
    ``others``: what ranks but zero do instead); return the checkpoint directory, what it held after
    each save, and how the run ended on this rank. ``slow``: rank zero's checkpoint writes are
    delayed (:class:`SlowRankZeroWrites`), the run saves at its end, and the kit adds no barrier of
    its own before it looks at the directory: only the backend's agreement on the save stands
    between the ranks."""
    checkpoints = saving(context, name, save_at_end=slow)
    trajectory = Trajectory(checkpoints.save_dir)
    args = make_args(context, name, checkpointer_args=checkpoints, **overrides)
    writer = SlowRankZeroWrites(checkpoints) if slow else None
    ended = "finished"
    try:
        make_trainer(context, model, args, [StopAt(step, how, skew, others), trajectory], writer).train()
    except (TrainingPreempted, AbruptStop) as stop:
        ended = ENDED[type(stop)]
    if not slow:
        barrier()
    trajectory.list_checkpoints()
    return checkpoints.save_dir or "", trajectory.listings, ended


def _resumed(context: Context, model: str, name: str, **overrides: Any) -> Dict[str, Any]:
    checkpoints = saving(context, name)
    trajectory = Trajectory(checkpoints.save_dir)
    args = make_args(context, name, checkpointer_args=checkpoints, **overrides)
    resumed = make_trainer(context, model, args, [trajectory])
    resumed.train()
    return {"state": full_state(resumed), **observed_path(resumed, trajectory)}


def _scenario(
    context: Context,
    model: str,
    name: str,
    how: str,
    step: int = 5,
    damage: bool = False,
    skew: int = 0,
    others: Optional[str] = None,
    **overrides: Any,
) -> Dict[str, Any]:
    """The resumed run's state and history (``name`` and ``name:history``), the step it started
    from, what the checkpoint directory held after each save of both runs and how the stopped run
    ended (``name:ended``); or the error that ended it (one scenario must not hide the others)."""
    try:
        save_dir, listings, ended = _stopped(context, model, name, how, step, skew, others, **overrides)
        if damage and context.rank == 0:
            damage_latest_checkpoint(save_dir)
        barrier()
        resumed = _resumed(context, model, name, **overrides)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # DCP raises BaseException
        return {name: described(error, 200)}
    return {
        name: resumed["state"],
        f"{name}:history": resumed["history"],
        f"{name}:started": resumed["started"],
        f"{name}:saved": [*listings, *resumed["saved"]],
        f"{name}:ended": ended,
    }


def _resume_features(*scenarios: str) -> Dict[str, Any]:
    """The ``register_feature`` arguments of a resume feature over ``scenarios``: each one's state
    and history compared with the uninterrupted run's (bitwise), the step it started from and the
    checkpoint directory's listings and how the stopped run ended (preempted, abrupt) equal to the reference's."""
    return {
        "compare": (),
        "resumed": tuple(f"{scenario}{part}" for scenario in scenarios for part in ("", ":history")),
        "exact": tuple(f"{scenario}{part}" for scenario in scenarios for part in (":started", ":saved", ":ended")),
    }


@register_feature("resume_kill9", quick=True, **_resume_features("abrupt", "damaged"))
def resume_kill9(context: Context, model: str) -> Dict[str, Any]:
    """An abrupt stop at step 5 (no final save, as after kill -9; the latest checkpoint: step 4)
    and the same with that checkpoint truncated (fallback to step 2), each resumed to the end:
    equal to an uninterrupted run of the same backend, step by step; resumed from the reference's
    step, with the reference's checkpoints on disk after each save."""
    return {
        **_uninterrupted(context, model),
        **_scenario(context, model, "abrupt", "abrupt"),
        **_scenario(context, model, "damaged", "abrupt", damage=True),
    }


_SIGNALS = _resume_features("SIGTERM", "SIGUSR1")


def _ending(
    context: Context,
    model: str,
    name: str,
    how: str,
    step: int,
    others: Optional[str] = None,
    slow: bool = False,
    **overrides: Any,
) -> Dict[str, Any]:
    """A stopped run, not resumed: how it ended on this rank (``name:ended``) and what the checkpoint
    directory held after each save (``name:saved``), the last listing taken as soon as ``train()``
    returned; or the error that ended it. (A stop request is part of the checkpoint: a run resumed
    from it stops again, so a scenario with one is judged by how it ended.)"""
    try:
        _, listings, ended = _stopped(context, model, name, how, step, 0, others, slow, **overrides)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # DCP raises BaseException
        return {f"{name}:ended": described(error, 200)}
    return {f"{name}:ended": ended, f"{name}:saved": listings}


@register_feature(
    "resume_signal",
    quick=True,
    compare=(),
    resumed=(*_SIGNALS["resumed"], "skewed", "one_rank"),
    exact=(*_SIGNALS["exact"], "skewed:ended", "one_rank:ended", "reasons:ended", "slow_io:ended", "slow_io:saved"),
)
def resume_signal(context: Context, model: str) -> Dict[str, Any]:
    """SIGTERM at step 5 and SIGUSR1 at step 3 (preemption: a checkpoint at that step), and SIGTERM
    a step apart on each rank (step 3 on rank 0, 4 on rank 1, no log point in between, where stop
    requests ride on the loss all-reduce: the ranks must agree on one stop step), each resumed to
    the end: equal to an uninterrupted run of the same backend, step by step; resumed from the
    reference's step, with the reference's checkpoints on disk. SIGTERM on rank 0 only (a
    node-level preemption): every rank must adopt rank 0's reason and stop with it. Different
    reasons per rank (``reasons``: SIGTERM on rank 0 at step 3 while every other rank asks to stop,
    as an ``EarlyStopping`` would): every rank must learn both and end preempted, as the reference
    does. And a run that ends at step 5 (``max_steps``) with a final save whose write is delayed on
    rank zero, looked at by every rank as soon as ``train()`` returns, with no barrier of the kit's
    (``slow_io``): no rank may leave the save before the file is in place."""
    return {
        **_uninterrupted(context, model),
        **_scenario(context, model, "SIGTERM", "SIGTERM", 5),
        **_scenario(context, model, "SIGUSR1", "SIGUSR1", 3),
        **_scenario(context, model, "skewed", "SIGTERM", 3, skew=1, log_every_n_steps=50),
        **_scenario(context, model, "one_rank", "SIGTERM", 3, skew=1000, log_every_n_steps=50),  # rank 1: never
        **_ending(context, model, "reasons", "SIGTERM", 3, others="request", log_every_n_steps=50),
        **_ending(context, model, "slow_io", "abrupt", 0, slow=True, max_steps=5),  # step 0: never stopped, ends at 5
    }


@register_feature("world_size_change", compare=("state",), ranks=(1, 2))  # 1 -> 2 ranks: one handover directory
def world_size_change(context: Context, model: str) -> Dict[str, Any]:
    """On 1 rank: stopped abruptly at step 5 (checkpoint at step 4); on 2 ranks: the same run
    (its output directory) resumed to the end. Both end with sp's uninterrupted weights."""
    handover = Context(**{**context.__dict__, "workdir": os.path.join(context.shared, "handover", model)})
    if context.world_size == 1:
        shutil.rmtree(run_dir(handover, "stopped"), ignore_errors=True)
        _stopped(handover, model, "stopped", "abrupt")
        return {"state": _uninterrupted(context, model)["uninterrupted"]}
    if not os.path.isdir(run_dir(handover, "stopped")):
        return {"error": "needs the 1-rank run first (it writes the checkpoint the 2-rank run resumes): --ranks 1,2"}
    return {"state": _resumed(handover, model, "stopped")["state"]}


def damage_latest_checkpoint(save_dir: str) -> Optional[str]:
    """Truncate the newest checkpoint in ``save_dir`` (its largest file, for a sharded one); return its path."""
    names = sorted(name for name in os.listdir(save_dir) if name.startswith("checkpoint") and not name.startswith("."))
    if not names:
        return None
    latest = os.path.join(save_dir, names[-1])
    target = latest
    if os.path.isdir(latest):
        files = [os.path.join(latest, name) for name in os.listdir(latest)]
        target = max((path for path in files if os.path.isfile(path)), key=os.path.getsize)
    size = os.path.getsize(target)
    with open(target, "r+b") as handle:
        handle.truncate(size // 2)
    return latest
