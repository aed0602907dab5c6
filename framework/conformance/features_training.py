"""Training features of the conformance matrix: optimization, accumulation, clipping,
precision, the automatic micro-batch, activation checkpointing, compile, stopping, loaders."""

from typing import Any, Dict, List, Optional

import torch.distributed as dist

from backends.strategies.units import module_units
from framework.callbacks import EarlyStopping
from framework.conformance.checks import Context, find_unused, make_args, make_trainer
from framework.conformance.models import full_state
from framework.conformance.registry import MODELS, register_feature
from framework.conformance.trajectory import Trajectory, observed_path
from framework.metrics.loss_tracker import TrainingDiverged


def _trained(
    context: Context, model: str, name: str, options: Optional[Dict[str, Any]] = None, **overrides: Any
) -> Dict[str, Any]:
    if MODELS[model].unused_parameters:  # ddp must be told (as a user must): the others find them alone
        overrides = {**find_unused(context), **overrides}
    trajectory = Trajectory()
    trainer = make_trainer(context, model, make_args(context, name, **overrides), [trajectory], **(options or {}))
    trainer.train()
    module: Any = trainer.module
    units = len(module_units(module))
    return {
        **observed_path(trainer, trajectory),
        "state": full_state(trainer),
        "dtype": (module.compute_dtypes or ["-"])[0],
        "setup": list(module.setup_saw) == [context.rank, context.world_size],
        "logged": trainer.history.values("train_loss_epoch"),
        "accumulation": trainer.gradient_accumulation,
        "data_parallel_size": trainer.backend.data_parallel_size,
        "self": [
            ("sharding units", units == module.expected_units, f"{units} unit(s) of {module.expected_units} blocks"),
            *module.invariants(),
        ],
    }


PATH = ("history",)
"""The trajectory's numbers every training cell compares with the reference (see ``trajectory``)."""


@register_feature("automatic", compare=("state", "logged", *PATH), exact=("dtype", "setup", "series"), quick=True)
def automatic(context: Context, model: str) -> Dict[str, Any]:
    """Automatic optimization: global batch 16, one micro-batch per rank; the module's setup()
    sees its rank, train_step computes in the reference's dtype, every block is a unit."""
    return _trained(context, model, "automatic")


@register_feature("accumulation", compare=("state", *PATH), exact=("dtype", "series"), quick=True)
def accumulation(context: Context, model: str) -> Dict[str, Any]:
    """Gradient accumulation derived from gpu_batch_size_limit=4 (4 micro-batches on 1 rank, 2 per rank on 2)."""
    return _trained(context, model, "accumulation", gpu_batch_size_limit=4)


@register_feature("clipping", compare=("state", *PATH), exact=("series",), quick=True)
def clipping(context: Context, model: str) -> Dict[str, Any]:
    """Accumulation, two optimizers and gradient clipping (max_grad_norm=0.3): every optimizer's
    gradients unscaled and averaged first."""
    options = {"optimizers": 2}
    return _trained(context, model, "clipping", options, gpu_batch_size_limit=4, clip_grads=True, max_grad_norm=0.3)


@register_feature("manual", compare=("state", *PATH), exact=("series",), quick=True)
def manual(context: Context, model: str) -> Dict[str, Any]:
    """Manual optimization: two optimizers stepped by train_step (manual_backward, clip_gradients)."""
    return _trained(context, model, "manual", {"manual": True}, **find_unused(context))


@register_feature("auto_micro_batch")
def auto_micro_batch(context: Context, model: str) -> Dict[str, Any]:
    """gpu_batch_size_limit="auto" where only 4 samples fit: the micro-batch found, weights as sp's."""
    observed = _trained(context, model, "auto", {"fits": 4}, gpu_batch_size_limit="auto")
    wanted = 16 // observed.pop("data_parallel_size") // 4  # tensor-parallel peers share a micro-batch
    found = observed["accumulation"]
    observed["self"].append(("accumulation", found == wanted, f"accumulation {found} (want {wanted})"))
    return observed


@register_feature("activation_checkpointing")
def activation_checkpointing(context: Context, model: str) -> Dict[str, Any]:
    """activation_checkpointing=True with accumulation: recomputed forwards, the same weights."""
    return _trained(context, model, "checkpointing", gpu_batch_size_limit=4, activation_checkpointing=True)


@register_feature("compile", models=("mlp", "buffers"), every_backend=False, ranks=(1, 2))  # inductor: seconds per rank
def compiled(context: Context, model: str) -> Dict[str, Any]:
    """compile=True (torch.compile of each unit): the same weights as sp compiled."""
    return _trained(context, model, "compile", compile=True, epochs=1)


@register_feature("early_stopping", compare=(), exact=("stopped",), models=("mlp",))
def early_stopping(context: Context, model: str) -> Dict[str, Any]:
    """EarlyStopping (mode max on a falling metric, patience 1) stops after the same epoch and step."""
    stopper = EarlyStopping(monitor="val_weighted", mode="max", patience=1)
    trainer = make_trainer(context, model, make_args(context, "early_stopping", epochs=4), callbacks=[stopper])
    trainer.train()
    return {"stopped": [trainer.epochs_finished, trainer.global_steps_finished]}


@register_feature("nan_stop", compare=(), exact=("step",), models=("mlp",))
def nan_stop(context: Context, model: str) -> Dict[str, Any]:
    """A NaN loss from step 3 on ends the run with TrainingDiverged naming the same step."""
    trainer = make_trainer(context, model, make_args(context, "nan", log_every_n_steps=1), nan_at_step=3)
    try:
        trainer.train()
    except TrainingDiverged as diverged:
        return {"step": diverged.step}
    return {"step": None}


@register_feature("workers", models=("mlp",))
def loader_workers(context: Context, model: str) -> Dict[str, Any]:
    """Augmentation drawn from torch's global generator in 2 loader workers: the same weights."""
    trainer = make_trainer(context, model, make_args(context, "workers"), loader="workers")
    trainer.train()
    return {"state": full_state(trainer)}


@register_feature("streams", compare=(), exact=("seen",), models=("mlp",), quick=True)
def streams(context: Context, model: str) -> Dict[str, Any]:
    """A stream split by rank and loader worker (2 workers): every sample seen once over the ranks."""
    trainer = make_trainer(context, model, make_args(context, "stream", epochs=1), loader="stream")
    trainer.train()
    module: Any = trainer.module
    share = (trainer.backend.data_parallel_rank, sorted(module.seen))
    shares = [share]
    if dist.is_available() and dist.is_initialized():
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, share)
        shares = gathered
    by_rank: Dict[int, Any] = {}  # tensor-parallel peers of one data-parallel rank read the same share
    agreed = all(by_rank.setdefault(rank, seen) == seen for rank, seen in shares)
    seen = sorted(index for part in by_rank.values() for index in part)
    return {"seen": seen, "self": [("peers", agreed, f"{len(by_rank)} data-parallel share(s)")]}
