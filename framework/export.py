"""Handing a trained module to the rest of the ecosystem: its weights as ``.safetensors`` (or
``.pt``), and the module as a ``torch.export`` program or an ONNX model.

:class:`~framework.Trainer` calls these from ``export_weights`` and ``export``; see
``docs/export.md``.
"""

import logging
import os
import sys
import warnings
from typing import Any, Tuple

import torch

from framework.checkpoint import storage
from framework.checkpoint.safetensors_io import SUFFIX, ShardSize, parse_shard_size, save_safetensors
from framework.evaluation.weights import CheckpointChoice, on_main_then_everywhere

logger = logging.getLogger("framework")

FORMATS = ("torch.export", "onnx")


def export_weights(trainer: Any, path: str, checkpoint: CheckpointChoice = None, max_shard_size: ShardSize = None) -> str:
    """Write the module's ``state_dict()`` (its own keys) to ``path`` on rank zero; return where it went.

    ``.safetensors``: safetensors, in Hugging Face's sharded layout above ``max_shard_size``
    (the index's URL is returned then); ``.pt``: a ``torch.save`` of ``{"model": state_dict}``
    (what ``load_weights`` and ``save_model_checkpoint`` files hold). ``checkpoint`` chooses
    the weights as in ``Trainer.validate`` (None: the current ones; ``"best"``, ``"last"`` or a
    path are loaded into the module first). Under fsdp the shards are gathered first.
    Collective: call it on every rank.

    Raises:
        ValueError: another suffix, or a bad ``max_shard_size`` (on every rank, before anything is gathered).
    """
    if not str(path).endswith((SUFFIX, ".pt")):
        raise ValueError(f"export_weights({path!r}): the file name must end in '.safetensors' or '.pt'")
    parse_shard_size(max_shard_size)
    if max_shard_size is not None and not str(path).endswith(SUFFIX):
        raise ValueError(f"export_weights({path!r}, max_shard_size={max_shard_size!r}): only .safetensors files are sharded")
    _warn_if_pretrained(trainer.module)
    trainer.load_checkpoint_weights(checkpoint, "export_weights")
    state = trainer.backend.unsharded(trainer.module.state_dict())  # fsdp: gathered on every rank

    def write() -> str:
        if str(path).endswith(SUFFIX):
            return save_safetensors(state, path, max_shard_size)
        fs, target = storage.resolve(path)
        storage.write_atomically(fs, target, {"model": state})
        return fs.unstrip_protocol(target)

    url = on_main_then_everywhere(trainer.backend, write, f"export weights to {path!r}")
    logger.info("export_weights: wrote %s", url)
    return url


def export_program(
    trainer: Any, path: str, example_inputs: Tuple[Any, ...], format: str = "torch.export", checkpoint: CheckpointChoice = None
) -> str:
    """Export ``trainer.module`` (its ``forward``) for inference on rank zero; return ``path``.

    ``format="torch.export"``: ``torch.export.export`` of the module in eval mode, saved with
    ``torch.export.save`` (load it with ``torch.export.load(path).module()``), conventionally
    ``.pt2``. ``format="onnx"``: ``torch.onnx.export(..., dynamo=True)`` (needs the ``[onnx]``
    extra), conventionally ``.onnx``. ``example_inputs`` is the tuple of positional arguments
    of ``forward``, moved to the module's device. ``checkpoint`` as in :func:`export_weights`.
    Collective: call it on every rank.

    Raises:
        ValueError: an unknown ``format``.
        TypeError: ``example_inputs`` is not a tuple, or the module has no ``forward``.
        NotImplementedError: under fsdp (export the weights, and the program from a plain process).
    """
    if format not in FORMATS:
        raise ValueError(f"export(format={format!r}) is unknown; allowed: {', '.join(map(repr, FORMATS))}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"export(example_inputs=...) must be a tuple of forward's positional arguments, got {type(example_inputs).__name__}"
        )
    if trainer.backend.shards_parameters:  # each rank holds part of the weights
        raise NotImplementedError(
            f"export() under the sharded {trainer.backend.strategy_name} strategy: write the weights with "
            "export_weights('model.safetensors'), then load them into the module in a plain process and export there"
        )
    if type(trainer.module).forward is torch.nn.Module.forward:
        raise TypeError(f"export(): {type(trainer.module).__name__} has no forward(); define the inference computation there")
    trainer.load_checkpoint_weights(checkpoint, "export")
    module = trainer.module

    def write() -> str:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        inputs = tuple(item.to(device) if isinstance(item, torch.Tensor) else item for item in example_inputs)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        was_training = module.training
        module.eval()
        try:
            if format == "torch.export":
                torch.export.save(torch.export.export(module, inputs), path)
            else:
                _require_onnx()
                torch.onnx.export(module, inputs, path, dynamo=True)
        finally:
            module.train(was_training)
        return path

    result = on_main_then_everywhere(trainer.backend, write, f"export to {path!r}")
    logger.info("export: wrote %s (%s)", result, format)
    return result


def _warn_if_pretrained(module: torch.nn.Module) -> None:
    """A transformers model under an attribute: these keys carry its prefix, which ``from_pretrained`` ignores."""
    if "transformers" not in sys.modules:  # never imports transformers
        return
    base: Any = getattr(sys.modules["transformers"], "PreTrainedModel", None)
    if base is None:
        return
    held = [name for name, child in module.named_modules() if name and isinstance(child, base)]
    if held and not isinstance(module, base):
        warnings.warn(
            f"export_weights(): the keys carry the prefix {held[0] + '.'!r} of the transformers model inside "
            f"{type(module).__name__}; from_pretrained() would load none of them. Use "
            "trainer.export_pretrained(directory) for a directory from_pretrained() loads",
            UserWarning,
            stacklevel=3,
        )


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ImportError("export(format='onnx') needs the extra: pip install 'torch-trainer-framework[onnx]'") from error
