"""ModelSummary: parameter counts per top-level child, logged when training starts."""

import logging
from typing import Iterable, List, NamedTuple, Tuple

import torch

from framework.callbacks.base import Callback

logger = logging.getLogger(__name__)


class SummaryRow(NamedTuple):
    """One line of the summary."""

    name: str
    type_name: str
    parameters: int
    trainable: int


def summary_rows(module: torch.nn.Module) -> List[SummaryRow]:
    """One row per top-level child, then one for parameters held by ``module`` itself (if any).

    Shared parameters are counted once, for the first child that holds them.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        >>> [(row.name, row.parameters) for row in summary_rows(net)]
        [('0', 9), ('1', 4)]
    """
    seen = set()
    rows = []

    def count(parameters: Iterable[torch.nn.Parameter]) -> Tuple[int, int]:
        total = trainable = 0
        for parameter in parameters:
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            total += parameter.numel()
            trainable += parameter.numel() if parameter.requires_grad else 0
        return total, trainable

    for name, child in module.named_children():
        total, trainable = count(child.parameters())
        rows.append(SummaryRow(name, type(child).__name__, total, trainable))
    total, trainable = count(module.parameters(recurse=False))
    if total:
        rows.append(SummaryRow("(own)", type(module).__name__, total, trainable))
    return rows


def format_summary(module: torch.nn.Module) -> str:
    """A table of :func:`summary_rows` with totals (trainable, frozen, size in MB)."""
    rows = summary_rows(module)
    total = sum(row.parameters for row in rows)
    trainable = sum(row.trainable for row in rows)
    megabytes = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    name_width = max([4] + [len(row.name) for row in rows])
    type_width = max([4] + [len(row.type_name) for row in rows])
    lines = [f"  {'name':<{name_width}}  {'type':<{type_width}}  {'params':>12}  {'trainable':>12}"]
    for row in rows:
        lines.append(f"  {row.name:<{name_width}}  {row.type_name:<{type_width}}  {row.parameters:>12,}  {row.trainable:>12,}")
    lines.append(f"  trainable: {trainable:,}  frozen: {total - trainable:,}  total: {total:,}  ({megabytes:.2f} MB)")
    return "\n".join(lines)


class ModelSummary(Callback):
    """Log the module's parameter counts (per top-level child, trainable and total) at the
    start of training, on rank zero. The text is kept in :attr:`summary`.

    Example:
        trainer = Trainer(module, args, callbacks=[ModelSummary()])
        trainer.train()
        print(trainer.callbacks[-1].summary)
    """

    def __init__(self) -> None:
        self.summary = ""

    def on_begin_train(self, global_step: int) -> None:
        self.summary = format_summary(self.trainer.module)
        if self.trainer.is_main_process:
            logger.info("model summary (%s):\n%s", type(self.trainer.module).__name__, self.summary)
