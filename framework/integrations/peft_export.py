"""A ``peft`` (LoRA) model exported so that it loads right: the merged base model, which
``from_pretrained`` reads, or the adapters in PEFT's own layout (``adapter_config.json``,
``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base, directory)`` reads.

Both are computed from the gathered weights (fsdp and model-parallel shard them; PEFT's own
``save_pretrained`` cannot read a shard) in a copy of the model built on the meta device and
given those weights, so the trained model is never changed. :func:`export_pretrained` in
``framework/integrations/transformers.py`` calls these; see ``docs/from-transformers.md``.
"""

import copy
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

PEFT_LAYOUTS = ("merged", "adapters")
"""``export_pretrained(peft_layout=...)``: the merged base model, or PEFT's adapter files."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def find_peft(module: torch.nn.Module, prefix: str) -> Optional[Tuple[str, Any]]:
    """``(peft_prefix, peft_model)``: the ``peft.PeftModel`` inside ``module`` that holds the
    ``PreTrainedModel`` found at ``prefix``, or None (never imports ``peft``).

    Example:
        >>> find_peft(torch.nn.Linear(1, 1), "")
    """
    peft = sys.modules.get("peft")
    base = getattr(peft, "PeftModel", None)
    if base is None:
        return None
    for name, child in module.named_modules():
        if isinstance(child, base) and (not name or prefix.startswith(name + ".")):
            return (name + "." if name else ""), child
    return None


def peft_base_model(found: Any) -> Optional[Tuple[str, Any]]:
    """``(prefix, model)``: where the ``PreTrainedModel`` a ``peft.PeftModel`` adapts sits inside it,
    or None for anything else (never imports ``peft``).

    Example:
        >>> peft_base_model(torch.nn.Linear(1, 1))
    """
    base = getattr(sys.modules.get("peft"), "PeftModel", None)
    if base is None or not isinstance(found, base):
        return None
    inner = found.get_base_model()
    return next(name + "." for name, child in found.named_modules() if child is inner), inner


def adapter_layers(model: torch.nn.Module) -> List[str]:
    """The names of the PEFT adapter layers (LoRA's ``lora_A``/``lora_B`` holders) inside ``model``.

    Example:
        >>> adapter_layers(torch.nn.Linear(1, 1))
        []
    """
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer = getattr(tuners, "BaseTunerLayer", None)
    if layer is None:
        return []
    return [name for name, child in model.named_modules() if isinstance(child, layer)]


def check_peft_export(peft_model: Any, layout: str) -> str:
    """The one adapter's name, once ``layout`` is known to fit ``peft_model`` (on every rank, before any gather).

    Raises:
        ValueError: an unknown ``layout``, several adapters, or ``"merged"`` for prompt learning (nothing to merge).
    """
    if layout not in PEFT_LAYOUTS:
        raise ValueError(f"peft_layout={layout!r} is invalid; allowed: {', '.join(map(repr, PEFT_LAYOUTS))}")
    names = list(peft_model.peft_config)
    if len(names) != 1:
        raise ValueError(
            f"export_pretrained(): the PEFT model holds the adapters {', '.join(map(repr, names))}; it exports one. "
            "Delete the others first (peft_model.delete_adapter(name)), or save each with PEFT in a plain process"
        )
    config = peft_model.peft_config[names[0]]
    if layout == "merged" and getattr(config, "is_prompt_learning", False):
        raise ValueError(
            f"export_pretrained(peft_layout='merged'): a {config.peft_type} adapter (prompt learning) has no weights "
            "to merge into the model; allowed here: peft_layout='adapters'"
        )
    return names[0]


def rebuilt(peft_model: Any, adapter: str, state: Dict[str, torch.Tensor]) -> Any:
    """A copy of ``peft_model`` built on the meta device, holding copies of ``state`` (its keys).

    Raises:
        ValueError: ``state`` does not fit the copy (missing or unexpected keys), naming them.
    """
    from peft import get_peft_model

    base = peft_model.get_base_model()
    with torch.device("meta"):
        fresh = get_peft_model(type(base)(base.config), copy.deepcopy(peft_model.peft_config[adapter]), adapter_name=adapter)
    copies = {key: value.detach().clone() for key, value in state.items()}  # merging adds into the base weights
    result = fresh.load_state_dict(copies, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"export_pretrained(): the PEFT model's weights do not fit a fresh copy of it; missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}; nothing was written"
        )
    return fresh


def merged_model(peft_model: Any, adapter: str, state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base model with the adapter merged into its weights (``merge_and_unload`` on a copy)."""
    merged: torch.nn.Module = rebuilt(peft_model, adapter, state).merge_and_unload()
    return merged


def adapter_files(peft_model: Any, adapter: str, state: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Any]:
    """``(weights, config)`` as ``PeftModel.save_pretrained`` writes them: PEFT's adapter keys, and
    the adapter's config in inference mode."""
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(rebuilt(peft_model, adapter, state), adapter_name=adapter)
    config = copy.deepcopy(peft_model.peft_config[adapter])
    config.inference_mode = True
    return {key: value.contiguous() for key, value in weights.items()}, config
