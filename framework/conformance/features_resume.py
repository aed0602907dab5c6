"""Resume features of the conformance matrix: after an abrupt stop (the in-process stand-in for
``kill -9``), after SIGTERM and SIGUSR1, from a damaged checkpoint, and on another world size."""

import contextlib
import os
import shutil
from typing import Any, Dict, List, Optional

from framework.conformance.checks import (
    AbruptStop,
    Context,
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
from framework.run.preemption import TrainingPreempted


def _uninterrupted(context: Context, model: str) -> List[float]:
    trainer = make_trainer(context, model, make_args(context, "uninterrupted"))
    trainer.train()
    return full_state(trainer)


def _stopped(context: Context, model: str, name: str, how: str, step: int = 5) -> str:
    """Train until ``how`` stops the run at ``step``; return the checkpoint directory."""
    checkpoints = saving(context, name)
    with contextlib.suppress(TrainingPreempted, AbruptStop):
        make_trainer(context, model, make_args(context, name, checkpointer_args=checkpoints), [StopAt(step, how)]).train()
    barrier()
    return checkpoints.save_dir or ""


def _resumed(context: Context, model: str, name: str) -> List[float]:
    resumed = make_trainer(context, model, make_args(context, name, checkpointer_args=saving(context, name)))
    resumed.train()
    return full_state(resumed)


def _scenario(context: Context, model: str, name: str, how: str, step: int = 5, damage: bool = False) -> Any:
    """The resumed run's state, or the error that ended it (one scenario must not hide the others)."""
    try:
        save_dir = _stopped(context, model, name, how, step)
        if damage and context.rank == 0:
            damage_latest_checkpoint(save_dir)
        barrier()
        return _resumed(context, model, name)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # DCP raises BaseException
        return described(error, 200)


@register_feature("resume_kill9", compare=(), resumed=("abrupt", "damaged"), quick=True)
def resume_kill9(context: Context, model: str) -> Dict[str, Any]:
    """An abrupt stop at step 5 (no final save, as after kill -9; the latest checkpoint: step 4)
    and the same with that checkpoint truncated (fallback to step 2), each resumed to the end:
    equal to an uninterrupted run of the same backend."""
    return {
        "uninterrupted": _uninterrupted(context, model),
        "abrupt": _scenario(context, model, "abrupt", "abrupt"),
        "damaged": _scenario(context, model, "damaged", "abrupt", damage=True),
    }


@register_feature("resume_signal", compare=(), resumed=("SIGTERM", "SIGUSR1"))
def resume_signal(context: Context, model: str) -> Dict[str, Any]:
    """SIGTERM at step 5 and SIGUSR1 at step 3 (preemption: a checkpoint at that step), each
    resumed to the end: equal to an uninterrupted run of the same backend."""
    return {
        "uninterrupted": _uninterrupted(context, model),
        "SIGTERM": _scenario(context, model, "sigterm", "SIGTERM", 5),
        "SIGUSR1": _scenario(context, model, "sigusr1", "SIGUSR1", 3),
    }


@register_feature("world_size_change", compare=("state",))
def world_size_change(context: Context, model: str) -> Dict[str, Any]:
    """On 1 rank: stopped abruptly at step 5 (checkpoint at step 4); on 2 ranks: the same run
    (its output directory) resumed to the end. Both end with sp's uninterrupted weights."""
    handover = Context(**{**context.__dict__, "workdir": os.path.join(context.shared, "handover", model)})
    if context.world_size == 1:
        shutil.rmtree(run_dir(handover, "stopped"), ignore_errors=True)
        _stopped(handover, model, "stopped", "abrupt")
        return {"state": _uninterrupted(context, model)}
    if not os.path.isdir(run_dir(handover, "stopped")):
        return {"error": "needs the 1-rank run first (it writes the checkpoint the 2-rank run resumes): --ranks 1,2"}
    return {"state": _resumed(handover, model, "stopped")}


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
