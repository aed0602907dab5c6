"""Evaluation features of the conformance matrix: validate/test/predict with
``checkpoint=None|"best"|"last"``, ``export_weights``, and the weight averages (EMA, SWA)."""

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from backends.checkpoint_io import run_files
from framework.callbacks import EMA, SWA
from framework.conformance.checks import Context, make_args, make_trainer, run_dir, saving
from framework.conformance.models import flat, full_state
from framework.conformance.registry import register_feature
from framework.evaluation.prediction import load_predictions

CONSISTENT = 1e-6
"""How far a metric evaluated from a checkpoint may be from the value recorded when it was saved."""


def _predicted(trainer: Any, checkpoint: Optional[str] = None) -> Dict[str, Any]:
    predicted = trainer.predict(checkpoint)
    if predicted is None:  # not rank zero
        return {}
    return {"predict_index": predicted["index"].tolist(), "predictions": predicted["prediction"].reshape(-1).tolist()}


def _predicted_to_files(context: Context, trainer: Any) -> Dict[str, Any]:
    """predict(predictions_dir=...) with every rank but 0 slowed down, then rank 0 reads the files at
    once: only the backend's barrier stands between rank 0 and the parts the others have not written yet."""
    module: Any = trainer.module
    if context.rank != 0:
        predict_step = module.predict_step

        def slowed(*arguments: Any) -> Any:
            time.sleep(0.2)
            return predict_step(*arguments)

        module.predict_step = slowed
    directory = os.path.join(run_dir(context, "evaluate"), "predictions")
    trainer.predict(predictions_dir=directory)
    if context.rank != 0:
        return {}
    loaded = load_predictions(directory)
    return {"predict_files": loaded["prediction"].reshape(-1).tolist()}


@register_feature(
    "evaluate", compare=("val", "test", "predictions", "predict_files"), exact=("val_order", "predict_index"), quick=True
)
def evaluate(context: Context, model: str) -> Dict[str, Any]:
    """validate/test/predict (checkpoint=None) after one epoch: outputs in dataset order (21
    samples, uneven shares), batch-size-weighted metrics; predict to files with the other ranks
    slowed down, read back by rank 0 as soon as predict returns (a missing barrier shows)."""
    trainer = make_trainer(context, model, make_args(context, "evaluate", epochs=1))
    trainer.train()
    module: Any = trainer.module
    observed: Dict[str, Any] = {"val": trainer.validate()["val_weighted"], "val_order": list(module.val_order)}
    observed["test"] = trainer.test()["val_weighted"]  # test_step is val_step: it logs the same name
    return {**observed, **_predicted(trainer), **_predicted_to_files(context, trainer)}


def _from_checkpoints(trainer: Any, recorded: List[float]) -> Dict[str, Any]:
    """validate/test/predict from "best" and "last", and whether they agree with what was recorded."""
    best = trainer.best_checkpoint()
    observed: Dict[str, Any] = {
        "best": os.path.basename(best.rstrip("/")).removesuffix(".pt") if best else None,
        "val_best": trainer.validate("best")["val_weighted"],
        "val_last": trainer.validate("last")["val_weighted"],
        "test_last": trainer.test("last")["val_weighted"],
        **_predicted(trainer, "best"),
    }
    checks: List[Tuple[str, bool, str]] = []
    for key, wanted in (("val_best", max(recorded)), ("val_last", recorded[-1])):
        gap = abs(observed[key] - wanted)
        checks.append((f"{key} as recorded", gap <= CONSISTENT, f"|{key} - recorded| = {gap:.2g}"))
    observed["self"] = checks
    observed["val_none"] = trainer.validate()["val_weighted"]
    return observed


@register_feature(
    "evaluate_checkpoints", compare=("val_best", "val_last", "test_last", "predictions", "val_none"), exact=("best",)
)
def evaluate_checkpoints(context: Context, model: str) -> Dict[str, Any]:
    """Epoch checkpoints scored by val_weighted (mode max), then validate/test/predict from
    "best" and "last", each equal to the value recorded when it was saved."""
    args = make_args(
        context,
        "checkpoints",
        epochs=3,
        checkpointer_args=saving(
            context, "checkpoints", period=1, save_every_n_steps=None, keep_best_n=1, metric="val_weighted", mode="max"
        ),
    )
    trainer = make_trainer(context, model, args)
    trainer.train()
    return _from_checkpoints(trainer, trainer.history.values("val_weighted"))


@register_feature("export_weights", compare=("exported",))
def export_weights(context: Context, model: str) -> Dict[str, Any]:
    """export_weights to a .pt file after training: the file holds the weights (and buffers) sp exports."""
    trainer = make_trainer(context, model, make_args(context, "export"))
    trainer.train()
    path = trainer.export_weights(os.path.join(run_dir(context, "export"), "weights.pt"))
    if context.rank != 0:
        return {}
    fs, inner = run_files.filesystem(path)
    return {"exported": flat(run_files.load_torch(fs, inner, run_files.CHECKPOINT)["model"])}


def _averaged(trainer: Any, average: Any) -> List[float]:
    return flat(trainer.backend.unsharded(average.averaged_state_dict()))


@register_feature("ema", compare=("state", "averaged", "val_best", "val_last", "val_none"), exact=("best",), quick=True)
def ema(context: Context, model: str) -> Dict[str, Any]:
    """EMA (decay 0.8, used for validation) over 3 epochs with checkpoints every 3 steps and per
    epoch scored by val_weighted; then validate from "best", "last" and memory."""
    average = EMA(decay=0.8)
    checkpoints = saving(context, "ema", period=1, save_every_n_steps=3, keep_best_n=1, metric="val_weighted", mode="max")
    trainer = make_trainer(context, model, make_args(context, "ema", epochs=3, checkpointer_args=checkpoints), [average])
    trainer.train()
    recorded = trainer.history.values("val_weighted")
    observed = {"state": full_state(trainer), "averaged": _averaged(trainer, average)}
    return {**observed, **_from_checkpoints(trainer, recorded)}


@register_feature("swa", compare=("state", "averaged"))
def swa(context: Context, model: str) -> Dict[str, Any]:
    """SWA from the second of 3 epochs (annealed over 1): the averaged weights sp ends with."""
    average = SWA(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    trainer = make_trainer(context, model, make_args(context, "swa", epochs=3), [average])
    trainer.train()
    return {"state": full_state(trainer), "averaged": _averaged(trainer, average)}


@register_feature("evaluate_buffers", compare=(), resumed=("last@memory",), models=("batchnorm",), ranks=(2, 4), quick=True)
def evaluate_buffers(context: Context, model: str) -> Dict[str, Any]:
    """Batch norm on 2 ranks (each rank's own running statistics after training): validating from
    memory gives the metrics validating from the "last" checkpoint (rank zero's statistics) gives."""
    checkpoints = saving(context, "buffers", save_every_n_steps=None, save_at_end=True)
    trainer = make_trainer(context, model, make_args(context, "buffers", epochs=1, checkpointer_args=checkpoints))
    trainer.train()

    def evaluated(checkpoint: Optional[str]) -> List[float]:
        validated = trainer.validate(checkpoint)
        return [validated[name] for name in sorted(validated)]

    return {"memory": evaluated(None), "last": evaluated("last")}
