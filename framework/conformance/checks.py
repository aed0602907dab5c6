"""The feature checks: each trains tiny modules on one backend and returns what it observed.

A check runs on every rank of one process group (or in one process) and returns plain data
(lists, numbers, strings). :mod:`framework.conformance.compare` turns a backend's
observations and the ``sp`` reference's into a table row.
"""

import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from backends import build_backend
from framework.callbacks import Callback, EarlyStopping
from framework.checkpoint import DefaultCheckpointerArguments
from framework.conformance.models import KitNet, KitTwoOptimizers, full_parameters
from framework.data.rng import seed_everything
from framework.loop.trainer import Trainer
from framework.metrics.loss_tracker import TrainingDiverged
from framework.run.arguments import TrainerArguments
from framework.run.preemption import TrainingPreempted


@dataclass
class Context:
    """Where a check runs: the backend's name, a directory shared by the ranks, the rank."""

    backend: str
    workdir: str
    rank: int = 0
    world_size: int = 1
    use_gpu: bool = False


class AbruptStop(BaseException):
    """Raised from a hook to end a run at once: no final checkpoint, as after ``kill -9``."""


class StopAt(Callback):
    """At optimizer step ``step``: send SIGTERM to this process, or end the run abruptly."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step == self.step:
            if self.how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise AbruptStop(f"stopped abruptly at step {global_step}")


def _args(context: Context, name: str, **overrides: Any) -> TrainerArguments:
    values: Dict[str, Any] = dict(
        backend=context.backend,
        epochs=2,
        train_batch_size=16,
        seed=0,
        disable_tqdm=True,
        model_summary=False,
        log_level="ERROR",
        use_gpu=context.use_gpu,
        ddp_timeout=120.0,
        output_dir=os.path.join(context.workdir, context.backend, name),
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    values.update(overrides)
    return TrainerArguments(**values)


def _trainer(make_module: Callable[[], Any], args: TrainerArguments, callbacks: Any = ()) -> Trainer:
    """The module built right after seeding, so every run starts from the same weights."""
    seed_everything(args.seed)
    return Trainer(make_module(), args, callbacks=callbacks)


def _saving(context: Context, name: str, **overrides: Any) -> DefaultCheckpointerArguments:
    values: Dict[str, Any] = dict(
        save_dir=os.path.join(context.workdir, context.backend, name, "checkpoints"),
        period=0,
        save_every_n_steps=2,
        save_at_end=False,
        resume="auto",
    )
    values.update(overrides)
    return DefaultCheckpointerArguments(**values)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# -- the checks --------------------------------------------------------------------------------
def automatic_optimization(context: Context) -> Dict[str, Any]:
    """Global batch 16 in micro-batches of 4 (accumulation derived per world size), clipped."""
    trainer = _trainer(KitNet, _args(context, "automatic", gpu_batch_size_limit=4, clip_grads=True, max_grad_norm=0.3))
    trainer.train()
    module: Any = trainer.module
    return {
        "params": full_parameters(trainer),
        "dtype": module.compute_dtypes[0],
        "setup": list(module.setup_saw),
        "accumulation": trainer.gradient_accumulation,
    }


def manual_optimization(context: Context) -> Dict[str, Any]:
    """Two optimizers stepped by ``train_step`` (body clipped, then head on detached features)."""
    # The head's optimizer leaves the body unused in its backward: DDP must look for unused
    # parameters; a backend that does not take the option (sp, fsdp) refuses it.
    unused = {"find_unused_parameters": True} if "find_unused_parameters" in build_backend(context.backend).options else {}
    trainer = _trainer(KitTwoOptimizers, _args(context, "manual", **unused))
    trainer.train()
    return {"params": full_parameters(trainer)}


def evaluation(context: Context) -> Dict[str, Any]:
    """validate/test/predict after one epoch: outputs in dataset order, batch-size-weighted metrics."""
    trainer = _trainer(KitNet, _args(context, "evaluation", epochs=1))
    trainer.train()
    module: Any = trainer.module
    validated = trainer.validate()
    val_order = list(module.val_order)
    tested = trainer.test()
    predicted = trainer.predict()
    observed: Dict[str, Any] = {
        "val_order": val_order,
        "val_weighted": validated.get("val_weighted"),
        "test_weighted": tested.get("val_weighted"),  # test_step is val_step: it logs the same name
    }
    if predicted is not None:  # rank zero
        observed["predict_index"] = predicted["index"].tolist()
        observed["predictions"] = predicted["prediction"].reshape(-1).tolist()
    return observed


def early_stopping(context: Context) -> Dict[str, Any]:
    """EarlyStopping (mode max on a falling metric, patience 1) stops after the second epoch of 4."""
    stopper = EarlyStopping(monitor="val_weighted", mode="max", patience=1)
    trainer = _trainer(KitNet, _args(context, "early_stopping", epochs=4), callbacks=[stopper])
    trainer.train()
    return {"epochs": trainer.epochs_finished, "steps": trainer.global_steps_finished}


def nan_stop(context: Context) -> Dict[str, Any]:
    """A NaN loss from step 3 on ends the run with TrainingDiverged naming step 3."""
    trainer = _trainer(lambda: KitNet(nan_at_step=3), _args(context, "nan", log_every_n_steps=1))
    try:
        trainer.train()
    except TrainingDiverged as diverged:
        return {"step": diverged.step}
    return {"step": None}


def _uninterrupted(context: Context) -> List[float]:
    trainer = _trainer(KitNet, _args(context, "uninterrupted"))
    trainer.train()
    return full_parameters(trainer)


def _stopped_then_resumed(context: Context, name: str, how: str, damage: bool = False) -> List[float]:
    saving = _saving(context, name)
    with contextlib.suppress(TrainingPreempted, AbruptStop):
        _trainer(KitNet, _args(context, name, checkpointer_args=saving), callbacks=[StopAt(5, how)]).train()
    _barrier()
    if damage and context.rank == 0:
        damage_latest_checkpoint(saving.save_dir or "")
    _barrier()
    resumed = _trainer(KitNet, _args(context, name, checkpointer_args=saving))
    resumed.train()
    return full_parameters(resumed)


def resume(context: Context) -> Dict[str, Any]:
    """SIGTERM at step 5, an abrupt stop at step 5 (the latest checkpoint: step 4), and a
    damaged latest checkpoint (fallback to step 2); each resumed to the end, against an
    uninterrupted run of the same backend."""
    observed: Dict[str, Any] = {"uninterrupted": _uninterrupted(context)}
    for key, how, damage in (("sigterm", "sigterm", False), ("abrupt", "abrupt", False), ("damaged", "abrupt", True)):
        try:
            observed[key] = _stopped_then_resumed(context, key, how, damage)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # one failing scenario must not hide the others (DCP raises BaseException)
            observed[key] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
    return observed


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


def evaluate_best(context: Context) -> Dict[str, Any]:
    """Epoch checkpoints scored by ``val_weighted`` (higher is better: the first epoch's),
    then ``validate("best")``."""
    saving = _saving(context, "best", period=1, save_every_n_steps=None, keep_best_n=1, metric="val_weighted", mode="max")
    trainer = _trainer(KitNet, _args(context, "best", epochs=3, checkpointer_args=saving))
    trainer.train()
    best = trainer.best_checkpoint()
    return {
        "best": os.path.basename(best.rstrip("/")).removesuffix(".pt") if best else None,  # a file or a directory of shards
        "val_weighted": trainer.validate("best")["val_weighted"],
    }


def loader_workers(context: Context) -> Dict[str, Any]:
    """Augmentation drawn from torch's global generator in 2 loader workers."""
    trainer = _trainer(lambda: KitNet(loader="workers"), _args(context, "workers"))
    trainer.train()
    return {"params": full_parameters(trainer)}


def streams(context: Context) -> Dict[str, Any]:
    """A stream split by rank and by loader worker (2 workers): which samples each rank saw."""
    trainer = _trainer(lambda: KitNet(loader="stream"), _args(context, "stream", epochs=1))
    trainer.train()
    seen: Any = trainer.module.seen
    return {"seen": list(seen), "data_parallel_rank": trainer.backend.data_parallel_rank}


CHECKS: Dict[str, Callable[[Context], Dict[str, Any]]] = {
    "automatic": automatic_optimization,
    "manual": manual_optimization,
    "evaluation": evaluation,
    "early_stopping": early_stopping,
    "nan_stop": nan_stop,
    "resume": resume,
    "best": evaluate_best,
    "workers": loader_workers,
    "streams": streams,
}
"""Every check by name, in the order they run."""


def run_checks(context: Context, names: List[str]) -> Dict[str, Any]:
    """Run the named checks in order; a check that raises is recorded as ``{"error": ...}``."""
    torch.set_num_threads(1)
    observed: Dict[str, Any] = {}
    for name in names:
        try:
            observed[name] = CHECKS[name](context)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            first = (str(error).strip().splitlines() or [""])[0][:300]
            observed[name] = {"error": f"{type(error).__name__}: {first}"}
    return observed
