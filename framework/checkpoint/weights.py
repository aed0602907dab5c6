"""Loading a checkpoint's weights into a module for inference, without a trainer."""

import logging
from typing import Any, Dict, Optional, Union

import torch

from framework.checkpoint import storage
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import FORMAT_NAME, Checkpoint
from framework.checkpoint.default import DefaultCheckpointer, checkpoint_name
from framework.checkpoint.safetensors_io import is_safetensors, load_safetensors

logger = logging.getLogger(__name__)

Step = Union[str, int]


def load_weights(
    module: torch.nn.Module,
    path_or_dir: str,
    step: Step = "last",
    metric: str = "val_loss",
    mode: str = "min",
    weights_only: bool = True,
) -> str:
    """Load the weights of a saved run into ``module`` (e.g. to evaluate or predict) and return
    the checkpoint's URL.

    ``path_or_dir`` is a checkpoint file (``checkpoint-*.pt`` or a ``model-*.pt`` export from
    ``Trainer.save_model_checkpoint``), a ``.safetensors`` file or sharded ``.safetensors.index.json``
    (``Trainer.export_weights``; a strict ``load_state_dict``), or a checkpoint directory (local path or fsspec URL),
    in which ``step`` picks:

    - ``"last"``: the newest checkpoint that reads back (a damaged newer one is skipped, as on resume);
    - ``"best"``: the one whose ``metric`` value, as recorded in the run's history at its step,
      is lowest (``mode="min"``) or highest (``mode="max"``);
    - an ``int``: the checkpoint taken after that many optimizer steps.

    A :class:`~framework.ModuleInterface` is restored with its ``update_state``; any other
    ``torch.nn.Module`` gets the saved ``state_dict``. The module is left on its device, in
    whatever train/eval mode it was (call ``module.eval()`` for inference).

    Raises:
        FileNotFoundError: no checkpoint there, or none for ``step``.
        ValueError: a bad ``step`` or ``mode``, or no recorded ``metric`` for ``"best"``.

    Example:
        module = MyModule()
        load_weights(module, "outputs/checkpoints", step="best")
        module.eval()
    """
    if not (step in ("last", "best") or (isinstance(step, int) and not isinstance(step, bool) and step >= 0)):
        raise ValueError(f"step={step!r} is invalid; allowed: 'last', 'best' or an optimizer step (an integer >= 0)")
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r} is invalid; allowed: 'min', 'max'")
    if is_safetensors(path_or_dir):  # a .safetensors file or a sharded index: the module's state_dict
        url, tensors = load_safetensors(path_or_dir)
        module.load_state_dict(tensors)
        logger.info("loaded weights from %s", url)
        return url
    fs, path = storage.resolve(path_or_dir)
    if fs.isfile(path):
        url, state = fs.unstrip_protocol(path), _read_module_state(fs, path, weights_only)
    elif not fs.isdir(path):
        raise FileNotFoundError(f"{path_or_dir!r} is neither a checkpoint file nor a directory")
    else:
        url, state = _from_directory(path_or_dir, step, metric, mode, weights_only)
    _apply(module, state, url)
    logger.info("loaded weights from %s", url)
    return url


def _read_module_state(fs: Any, path: str, weights_only: bool) -> Dict[str, Any]:
    data = storage.read(fs, path, weights_only=weights_only)
    if isinstance(data, dict) and data.get("format") == FORMAT_NAME:
        return Checkpoint.from_dict(data).module_state
    return data  # a model export: the module's get_state()


def _from_directory(directory: str, step: Step, metric: str, mode: str, weights_only: bool) -> "tuple[str, Dict[str, Any]]":
    checkpointer = DefaultCheckpointer(
        DefaultCheckpointerArguments(save_dir=directory, load_dir=directory, weights_only=weights_only)
    )
    if isinstance(step, int):
        url = storage.join(directory, checkpoint_name(step))
        return url, checkpointer.read(url).module_state
    latest = checkpointer.load()
    if latest is None:
        raise FileNotFoundError(f"{directory!r} holds no checkpoint-*.pt file")
    if step == "last":
        return str(checkpointer.loaded_from), latest.module_state
    scores = _scores_by_step(latest, metric)
    fs, path = storage.resolve(directory)
    ranked = sorted(scores, key=scores.__getitem__, reverse=mode == "max")
    for best_step in ranked:
        candidate = storage.join(path, checkpoint_name(best_step))
        if fs.exists(candidate):
            if best_step == latest.global_step:
                return str(checkpointer.loaded_from), latest.module_state
            url = fs.unstrip_protocol(candidate)
            return url, checkpointer.read(url).module_state
    recorded = sorted(scores)
    raise ValueError(
        f"no checkpoint in {directory!r} has a recorded {metric!r} (recorded at steps {recorded or 'none'}); "
        f"pass the metric the run validated (metric=...), or step='last' or a step number"
    )


def _scores_by_step(latest: Checkpoint, metric: str) -> Dict[int, float]:
    """``{step: value of metric at that step}`` from the run's history in its newest checkpoint."""
    history = latest.trainer_state.get("history", {}) if isinstance(latest.trainer_state, dict) else {}
    scores = {
        int(record["step"]): float(record["value"]) for record in history.get("records", []) if record.get("name") == metric
    }
    if metric in latest.metrics:
        scores[latest.global_step] = float(latest.metrics[metric])
    return scores


def _apply(module: torch.nn.Module, state: Dict[str, Any], url: Optional[str]) -> None:
    update_state = getattr(module, "update_state", None)
    if callable(update_state):
        update_state(state)
    else:
        module.load_state_dict(state["model"] if isinstance(state, dict) and "model" in state else state)
