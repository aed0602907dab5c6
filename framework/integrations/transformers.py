"""Hugging Face ``transformers`` models in the framework: weights that ``from_pretrained`` loads,
and a module that trains a ``PreTrainedModel`` as the ``transformers`` ``Trainer`` does.

- :func:`export_pretrained` writes a directory ``from_pretrained(directory)`` reads: the
  ``PreTrainedModel``'s own keys (no prefix of the attribute holding it), ``config.json``
  (and ``generation_config.json`` for generative models), ``model.safetensors`` or, above
  ``max_shard_size``, ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``.
  Collective: every backend (fsdp and model-parallel gather the shards first).
- :class:`PretrainedModule` trains a ``PreTrainedModel`` with the ``Trainer``'s defaults: the loss
  is ``outputs.loss``, the optimizer AdamW with the ``Trainer``'s weight-decay groups (no decay
  for biases and norm weights), the schedule linear warmup then linear decay, the gradients
  clipped to norm 1.0 (``max_grad_norm``); ``generate`` is the model's own.

Needs ``transformers`` (``pip install transformers``); see ``docs/from-transformers.md``.
"""

import logging
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from framework.checkpoint.safetensors_io import ShardSize, parse_shard_size, save_safetensors
from framework.evaluation.weights import CheckpointChoice, on_main_then_everywhere
from framework.integrations.peft_export import (
    ADAPTER_WEIGHTS,
    adapter_files,
    adapter_layers,
    check_peft_export,
    find_peft,
    merged_model,
    peft_base_model,
)
from framework.module import ModuleInterface

logger = logging.getLogger("framework")

WEIGHTS_NAME = "model.safetensors"
"""The file (or the stem of the shards and index) ``from_pretrained`` looks for."""
DEFAULT_SHARD_SIZE = "5GB"
"""``save_pretrained``'s default ``max_shard_size``."""


def pretrained_prefix(module: torch.nn.Module, attribute: Optional[str] = None) -> Tuple[str, torch.nn.Module]:
    """``(prefix, model)``: where the ``PreTrainedModel`` sits inside ``module``.

    ``attribute`` names it (dotted, e.g. ``"model"``; or the ``peft`` model holding it); None: ``module`` itself if it is a
    ``PreTrainedModel``, else its only ``PreTrainedModel`` that no other one contains.

    Raises:
        ValueError: no ``PreTrainedModel`` there, several and no ``attribute``, or ``attribute`` is not one.

    Example:
        >>> import torch
        >>> pretrained_prefix(torch.nn.Linear(1, 1))
        Traceback (most recent call last):
        ...
        ValueError: Linear holds no transformers PreTrainedModel; export_weights() writes plain modules
    """
    base = _pretrained_class()
    if attribute is not None:
        found: Any
        try:
            found = module.get_submodule(attribute) if attribute else module
        except AttributeError:
            found = getattr(module, attribute, None)
        inner = peft_base_model(found)  # a peft model: the PreTrainedModel it adapts
        if inner is not None:
            return (attribute + "." if attribute else "") + inner[0], inner[1]
        if not isinstance(found, base):
            raise ValueError(f"attribute={attribute!r} is a {type(found).__name__}, not a transformers PreTrainedModel")
        return (attribute + "." if attribute else ""), found
    if isinstance(module, base):
        return "", module
    outer = [(name, child) for name, child in module.named_modules() if name and isinstance(child, base)]
    outer = [(name, child) for name, child in outer if not any(name.startswith(other + ".") for other, _ in outer)]
    if not outer:
        raise ValueError(f"{type(module).__name__} holds no transformers PreTrainedModel; export_weights() writes plain modules")
    if len(outer) > 1:
        raise ValueError(
            f"{type(module).__name__} holds several PreTrainedModels ({', '.join(name for name, _ in outer)}); "
            "name one with attribute="
        )
    return outer[0][0] + ".", outer[0][1]


def export_pretrained(
    trainer: Any,
    directory: str,
    attribute: Optional[str] = None,
    checkpoint: CheckpointChoice = None,
    max_shard_size: ShardSize = DEFAULT_SHARD_SIZE,
    peft_layout: str = "merged",
) -> str:
    """Write the module's ``PreTrainedModel`` as ``save_pretrained`` does; return ``directory``.

    ``from_pretrained(directory)`` then loads it with no missing or unexpected keys. Keys are
    the model's own (the attribute holding it is stripped); tied weights are written once, as
    ``save_pretrained`` writes them. ``checkpoint`` as in ``Trainer.validate`` (``"best"``,
    ``"last"``, a path, or None for the current weights). Collective: call it on every rank.

    A ``peft`` model (LoRA...; the module's ``PeftModel`` holding the ``PreTrainedModel``) is written
    in ``peft_layout``: ``"merged"`` (default) the base model with the adapter merged into its
    weights, which ``from_pretrained(directory)`` loads; ``"adapters"`` PEFT's own files
    (``adapter_config.json``, ``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base,
    directory)`` loads. Both from the gathered weights, so on every backend.

    Raises:
        ValueError: no ``PreTrainedModel`` found (see :func:`pretrained_prefix`), a bad ``max_shard_size``
            or ``peft_layout``, PEFT adapter layers outside a ``PeftModel``, several adapters, or
            ``"merged"`` for a prompt-learning adapter; on every rank, before anything is gathered or written.

    Example:
        export_pretrained(trainer, "export/bert")   # then BertForSequenceClassification.from_pretrained("export/bert")
    """
    parse_shard_size(max_shard_size)
    prefix, found = pretrained_prefix(trainer.module, attribute)
    model: Any = found
    peft = find_peft(trainer.module, prefix)
    if peft is None and peft_layout != "merged":
        raise ValueError(f"peft_layout={peft_layout!r}: {type(model).__name__} is no peft model; allowed: 'merged' (the default)")
    if peft is None and adapter_layers(model):
        raise ValueError(
            f"export_pretrained(): {type(model).__name__} holds PEFT adapter layers ({adapter_layers(model)[0]}, ...) "
            "outside a peft.PeftModel, whose keys from_pretrained would not load; wrap it with peft.get_peft_model"
        )
    adapter = check_peft_export(peft[1], peft_layout) if peft is not None else ""
    trainer.load_checkpoint_weights(checkpoint, "export_pretrained")
    state = trainer.backend.unsharded(trainer.module.state_dict())  # fsdp / model-parallel: gathered

    def write() -> str:
        os.makedirs(directory, exist_ok=True)
        if peft is not None and peft_layout == "adapters":
            own = {key[len(peft[0]) :]: value for key, value in state.items() if key.startswith(peft[0])}
            weights, config = adapter_files(peft[1], adapter, own)
            save_safetensors(weights, os.path.join(directory, ADAPTER_WEIGHTS), None)
            config.save_pretrained(directory)  # adapter_config.json
            return directory
        if peft is not None:  # the adapter merged into the base weights, in a copy
            merged = merged_model(peft[1], adapter, {k[len(peft[0]) :]: v for k, v in state.items() if k.startswith(peft[0])})
            own, tied = merged.state_dict(), set(_tied_keys(merged))
        else:
            own = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
            tied = set(_tied_keys(model)) & set(own)
        weights = {key: value for key, value in own.items() if key not in tied}
        save_safetensors(weights, os.path.join(directory, WEIGHTS_NAME), max_shard_size)
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(directory)
        return directory

    result = on_main_then_everywhere(trainer.backend, write, f"export_pretrained to {directory!r}")
    logger.info("export_pretrained: wrote %s%s", result, f" (peft: {peft_layout})" if peft is not None else "")
    return result


def no_decay_parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """The ``transformers`` ``Trainer``'s AdamW groups: decay for every weight but biases and norms.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> [len(group["params"]) for group in no_decay_parameter_groups(net, 0.01)]
        [1, 3]
    """
    no_decay: List[str] = []
    for module_name, child in model.named_modules():
        is_norm = isinstance(child, (torch.nn.LayerNorm, torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm))
        is_norm = is_norm or "norm" in type(child).__name__.lower()
        for name, _ in child.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if is_norm or "bias" in name:
                no_decay.append(full)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for name, p in named if name not in no_decay], "weight_decay": weight_decay},
        {"params": [p for name, p in named if name in no_decay], "weight_decay": 0.0},
    ]


def linear_warmup_decay(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> Any:
    """``get_linear_schedule_with_warmup``: from 0 to the learning rate in ``warmup_steps``, then linearly to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class PretrainedModule(ModuleInterface):
    """Train a ``transformers`` ``PreTrainedModel`` as its ``Trainer`` would.

    Batches are dicts of the model's keyword arguments (``input_ids``, ``attention_mask``,
    ``labels``...), as a ``transformers`` data collator returns them; the loss is the model's
    ``outputs.loss``. Validation logs ``val_loss`` and, for classifiers (logits
    ``[batch, classes]``), ``accuracy``. ``self.model`` is the untouched model
    (``self.model.generate(...)`` works), so :func:`export_pretrained` finds it.

    Args:
        model: the ``PreTrainedModel`` (with a head that computes a loss from ``labels``).
        train_dataset / eval_dataset: map-style datasets of examples.
        collate_fn: turns a list of examples into a batch dict (e.g. ``DataCollatorWithPadding``).
        learning_rate, weight_decay, warmup_steps, warmup_ratio, adam_beta1, adam_beta2, adam_epsilon,
            max_grad_norm: as ``TrainingArguments`` names them, with its defaults: gradients are
            clipped to total norm 1.0 (``max_grad_norm=None`` or ``0`` turns clipping off, as there;
            ``TrainerArguments(clip_grads=True, max_grad_norm=...)`` overrides it). ``warmup_ratio``
            counts ``ceil(ratio * total steps)`` warmup steps when ``warmup_steps`` is 0 (transformers
            4's field); a ``warmup_steps`` below 1 is that ratio (transformers 5's spelling).

    Example (docs/from-transformers.md runs it whole; tests/test_transformers.py trains it)::

        from transformers import BertConfig, BertForSequenceClassification
        model = BertForSequenceClassification(BertConfig(num_labels=2))
        module = PretrainedModule(model, train_dataset, eval_dataset, collate_fn=collator)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_dataset: Dataset,
        eval_dataset: Optional[Dataset] = None,
        collate_fn: Optional[Callable[[Sequence[Any]], Any]] = None,
        learning_rate: float = 5e-5,
        weight_decay: float = 0.0,
        warmup_steps: float = 0,
        adam_epsilon: float = 1e-8,
        max_grad_norm: Optional[float] = 1.0,
        warmup_ratio: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
    ) -> None:
        super().__init__()
        pretrained_prefix(model)
        if isinstance(max_grad_norm, bool) or not (max_grad_norm is None or max_grad_norm >= 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid; allowed: a number > 0, or None or 0 (no clipping)")
        if not 0.0 <= warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio={warmup_ratio!r} is invalid; allowed: a number in [0, 1]")
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None  # the transformers Trainer clips at 1.0
        self.warmup_ratio, self.adam_betas = warmup_ratio, (adam_beta1, adam_beta2)
        self.model = model
        self.train_dataset, self.eval_dataset, self.collate_fn = train_dataset, eval_dataset, collate_fn
        self.learning_rate, self.weight_decay, self.warmup_steps, self.adam_epsilon = (
            learning_rate,
            weight_decay,
            warmup_steps,
            adam_epsilon,
        )

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Tuple[List[Any], List[Any]]:
        groups = no_decay_parameter_groups(self.model, self.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.learning_rate, betas=self.adam_betas, eps=self.adam_epsilon)
        total = estimated_global_steps_per_epoch * epochs
        ratio = self.warmup_steps if 0 < self.warmup_steps < 1 else self.warmup_ratio  # transformers 5: a float < 1
        warmup = int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(ratio * total)  # get_warmup_steps
        return [optimizer], [linear_warmup_decay(optimizer, warmup, total)]

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(
            self.train_dataset, batch_size=batch_size, sampler=sampler(self.train_dataset), collate_fn=self.collate_fn
        )

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Optional[DataLoader]:
        if self.eval_dataset is None:
            return None
        data = self.eval_dataset
        return DataLoader(data, batch_size=batch_size, sampler=sampler(data), collate_fn=self.collate_fn)

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        return self.model(**batch).loss

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        outputs = self.model(**batch)
        labels: Any = batch.get("labels") if isinstance(batch, dict) else None
        size = int(labels.shape[0]) if isinstance(labels, torch.Tensor) else None
        logits: Any = getattr(outputs, "logits", None)
        if size is not None and isinstance(logits, torch.Tensor) and logits.dim() == 2 and labels.dim() == 1:
            self.log("accuracy", (logits.argmax(-1) == labels).float().mean(), batch_size=size)
        return outputs.loss


def _tied_keys(model: torch.nn.Module) -> List[str]:
    """Keys ``save_pretrained`` leaves out: the later names of a parameter shared under several names."""
    seen: Dict[int, str] = {}
    tied = []
    for key, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.append(key)
        else:
            seen[id(parameter)] = key
    return tied


def _pretrained_class() -> Any:
    try:
        from transformers import PreTrainedModel
    except ImportError as error:
        raise ImportError("framework.integrations.transformers needs transformers: pip install transformers") from error
    return PreTrainedModel
