"""Loading a checkpoint's weights into a module for inference, without a trainer."""

import logging
from typing import Any, Dict, Optional, Tuple, Union

import torch

from backends.checkpoint_io import SHARDED_NAME, run_files
from backends.strategies import SingleProcess, Strategy
from framework.checkpoint import storage
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.checkpoint import FORMAT_NAME, Checkpoint
from framework.checkpoint.default import DefaultCheckpointer, checkpoint_name
from framework.checkpoint.file_io import FileIO
from framework.checkpoint.retention import check_name_agrees
from framework.checkpoint.safetensors_io import is_safetensors, load_safetensors

logger = logging.getLogger(__name__)

Step = Union[str, int]


def load_weights(
    module: torch.nn.Module,
    path_or_dir: str,
    step: Step = "last",
    metric: Optional[str] = None,
    mode: Optional[str] = None,
    weights_only: bool = True,
    strategy: Optional[Strategy] = None,
) -> str:
    """Load the weights of a saved run into ``module`` (e.g. to evaluate or predict) and return
    the checkpoint's URL.

    ``path_or_dir`` is a checkpoint (a ``checkpoint-*.pt`` file, a ``checkpoint-<step>/``
    directory of shards written under ``fsdp``, or a ``model-*.pt`` export from
    ``Trainer.save_model_checkpoint``), a ``.safetensors`` file or sharded
    ``.safetensors.index.json`` (``Trainer.export_weights``; a strict ``load_state_dict``), or a
    directory of checkpoints (local path or fsspec URL), in which ``step`` picks:

    - ``"last"``: the newest checkpoint that reads back (a damaged newer one is skipped, as on resume);
    - ``"best"``: the one whose ``metric`` value, as recorded in the run's history at its step,
      is lowest (``mode="min"``) or highest (``mode="max"``); by default the metric and mode
      the run ranked its checkpoints by (``checkpointer_args.metric``/``mode``, recorded in its
      checkpoints; ``"val_loss"``/``"min"`` for checkpoints written before they were);
    - an ``int``: the checkpoint taken after that many optimizer steps.

    Without ``strategy`` the full weights are read in this process alone (sharded ones too: no
    process group is needed). With one (the trainer's, on every rank), the strategy reads
    them into ``module``'s own tensors (``fsdp``: each rank its shards).

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
    # A .safetensors file or a sharded index is the module's state_dict; else a checkpoint or a directory of them.
    url = path_or_dir if is_safetensors(path_or_dir) else resolve_checkpoint(path_or_dir, step, metric, mode, weights_only)
    return load_checkpoint_into(module, url, weights_only, strategy)[0]


def load_checkpoint_into(
    module: torch.nn.Module,
    url: str,
    weights_only: bool = True,
    strategy: Optional[Strategy] = None,
    trainer_target: Optional[Dict[str, Any]] = None,
) -> Tuple[str, Dict[str, Any]]:
    """Load the weights of the checkpoint, model export or safetensors file ``url`` into
    ``module``; return its URL and its trainer state (``{}`` for an export).

    ``strategy`` as for :func:`load_weights`; with one, the trainer-state tensors that
    ``trainer_target`` holds (e.g. ``{"callbacks": [...]}``: a weight average) are read into
    them too (``fsdp``: this rank's shards), the others not at all.

    Example:
        url, trainer_state = load_checkpoint_into(module, "outputs/checkpoints/checkpoint-000000100.pt")
    """
    if is_safetensors(url):
        url, tensors = load_safetensors(url)
        module.load_state_dict(tensors)
        logger.info("loaded weights from %s", url)
        return url, {}
    io = FileIO(weights_only=weights_only)
    if strategy is None:
        data = SingleProcess().load_checkpoint(url, io)
    else:
        data = strategy.load_checkpoint(url, io, target=lambda: {"module": _state_of(module), "trainer": trainer_target or {}})
    checkpoint = Checkpoint.from_dict(data) if isinstance(data, dict) and data.get("format") == FORMAT_NAME else None
    if checkpoint is not None:
        check_name_agrees(url, checkpoint.global_step)
    _apply(module, data if checkpoint is None else checkpoint.module_state, url)  # else a model export: get_state()
    logger.info("loaded weights from %s", url)
    return url, {} if checkpoint is None else checkpoint.trainer_state


def resolve_checkpoint(
    path_or_dir: str, step: Step = "last", metric: Optional[str] = None, mode: Optional[str] = None, weights_only: bool = True
) -> str:
    """The URL of the checkpoint :func:`load_weights` would load (same arguments); a directory of
    checkpoints is searched (and its candidates read) in this process alone."""
    if not (step in ("last", "best") or (isinstance(step, int) and not isinstance(step, bool) and step >= 0)):
        raise ValueError(f"step={step!r} is invalid; allowed: 'last', 'best' or an optimizer step (an integer >= 0)")
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode={mode!r} is invalid; allowed: 'min', 'max'")
    fs, path = storage.resolve(run_files.named_by_user(path_or_dir))
    if fs.isfile(path) or (fs.isdir(path) and SHARDED_NAME.match(path.rstrip("/").rsplit("/", 1)[-1])):
        return fs.unstrip_protocol(path)
    if not fs.isdir(path):
        if fs.exists(path):  # a FIFO, a device, a link...: the one door names what it is
            return fs.unstrip_protocol(path)
        raise FileNotFoundError(f"{path_or_dir!r} is neither a checkpoint nor a directory")
    return _from_directory(path_or_dir, step, metric, mode, weights_only)


def _state_of(module: torch.nn.Module) -> Dict[str, Any]:
    get_state = getattr(module, "get_state", None)
    return get_state() if callable(get_state) else {"model": module.state_dict()}


def _from_directory(directory: str, step: Step, metric: Optional[str], mode: Optional[str], weights_only: bool) -> str:
    checkpointer = DefaultCheckpointer(
        DefaultCheckpointerArguments(save_dir=directory, load_dir=directory, weights_only=weights_only)
    )
    fs, path = storage.resolve(directory)
    if isinstance(step, int):
        return _existing(fs, path, step, directory)
    latest = checkpointer.load()
    if latest is None:
        raise FileNotFoundError(f"{directory!r} holds no checkpoint (checkpoint-*.pt file or checkpoint-* directory)")
    if step == "last":
        return str(checkpointer.loaded_from)
    chosen = latest.trainer_state.get("checkpointer", {}) if isinstance(latest.trainer_state, dict) else {}
    metric = metric or chosen.get("metric") or "val_loss"  # the run's own choice
    mode = mode or (chosen.get("mode") if chosen.get("metric") == metric else None) or "min"
    scores = _scores_by_step(latest, metric)
    ranked = sorted(scores, key=scores.__getitem__, reverse=mode == "max")
    for best_step in ranked:
        if best_step == latest.global_step:
            return str(checkpointer.loaded_from)
        try:
            return _existing(fs, path, best_step, directory)
        except FileNotFoundError:
            continue
    recorded = sorted(scores)
    raise ValueError(
        f"no checkpoint in {directory!r} has a recorded {metric!r} (recorded at steps {recorded or 'none'}); "
        f"pass the metric the run validated (metric=...), or step='last' or a step number"
    )


def _existing(fs: Any, path: str, step: int, directory: str) -> str:
    """The URL of the checkpoint of ``step`` in ``path`` (a file or a directory of shards)."""
    for suffix in (".pt", ""):
        candidate = storage.join(path, checkpoint_name(step, suffix))
        if fs.exists(candidate):
            return fs.unstrip_protocol(candidate)
    raise FileNotFoundError(
        f"checkpoint file {storage.join(directory, checkpoint_name(step))!r} does not exist "
        f"(nor a sharded checkpoint directory {checkpoint_name(step, '')!r})"
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
