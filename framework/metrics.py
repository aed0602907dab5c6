"""Metric history (queryable, checkpointed) and the device-side collector behind ``module.log``."""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

_REDUCTIONS = ("mean", "sum", "max", "min")


class MetricHistory:
    """Every metric value a run recorded, in order.

    Example:
        >>> history = MetricHistory()
        >>> _ = history.add("val_loss", 0.5, step=10, epoch=0)
        >>> _ = history.add("val_loss", 0.4, step=20, epoch=1)
        >>> history.values("val_loss"), history.latest("val_loss")
        ([0.5, 0.4], 0.4)
    """

    FIELDS = ("epoch", "step", "name", "value")

    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []

    def add(self, name: str, value: float, step: int, epoch: int) -> Dict[str, Any]:
        """Append one value and return its record."""
        record = {"epoch": int(epoch), "step": int(step), "name": name, "value": float(value)}
        self.records.append(record)
        return record

    def values(self, name: str) -> List[float]:
        """All values of ``name``, oldest first."""
        return [record["value"] for record in self.records if record["name"] == name]

    def steps(self, name: str) -> List[Tuple[int, float]]:
        """``(step, value)`` pairs of ``name``."""
        return [(record["step"], record["value"]) for record in self.records if record["name"] == name]

    def latest(self, name: str, default: Optional[float] = None) -> Optional[float]:
        """The newest value of ``name``, or ``default``."""
        for record in reversed(self.records):
            if record["name"] == name:
                return record["value"]
        return default

    def latest_values(self) -> Dict[str, float]:
        """The newest value of every metric."""
        return {record["name"]: record["value"] for record in self.records}

    def names(self) -> List[str]:
        """Metric names in first-seen order."""
        return list(dict.fromkeys(record["name"] for record in self.records))

    def __len__(self) -> int:
        return len(self.records)

    def state_dict(self) -> Dict[str, Any]:
        return {"records": [dict(record) for record in self.records]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.records = [dict(record) for record in state["records"]]


class MetricCollector:
    """Collects ``module.log(...)`` values on the device until the trainer writes them.

    Nothing here reads a tensor back to the host: step values are kept as the latest
    tensor, epoch values as a running sum/max/min plus a count. A tensor value stays on its
    device; a Python number becomes a CPU tensor (the trainer moves it before reducing).

    Example:
        >>> collector = MetricCollector()
        >>> collector.log("acc", torch.tensor(0.5)); collector.log("acc", torch.tensor(1.0))
        >>> {name: float(value) for name, (value, _) in collector.pop_epoch().items()}
        {'acc': 0.75}
    """

    def __init__(self) -> None:
        self._step: Dict[str, Tuple[torch.Tensor, str]] = {}
        self._epoch: Dict[str, List[Any]] = {}
        self._reductions: Dict[str, str] = {}
        self._on_step: set = set()

    def log(
        self, name: str, value: Union[torch.Tensor, float], on_step: bool = False, on_epoch: bool = True, reduce: str = "mean"
    ) -> None:
        """Keep ``value`` (a tensor with one or more elements, or a number) under ``name``.

        A tensor with several elements is first reduced with ``reduce`` (``mean`` of a
        per-sample tensor, etc.).

        Raises:
            ValueError: an empty name, an unknown ``reduce``, a ``reduce`` that differs from
                an earlier call for the same name, or ``on_step`` and ``on_epoch`` both off.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"log(name={name!r}): the name must be a non-empty string")
        if reduce not in _REDUCTIONS:
            raise ValueError(f"log({name!r}, reduce={reduce!r}): allowed reductions are {_REDUCTIONS}")
        if not (on_step or on_epoch):
            raise ValueError(f"log({name!r}, on_step=False, on_epoch=False) would record nothing; set one of them")
        previous = self._reductions.setdefault(name, reduce)
        if previous != reduce:
            raise ValueError(f"log({name!r}, reduce={reduce!r}): this metric was logged with reduce={previous!r}")
        if isinstance(value, torch.Tensor):
            value = value.detach().float()
            if hasattr(value, "full_tensor"):  # a DTensor (a sharded model's norm): its value on every rank
                value = value.full_tensor()
        elif isinstance(value, (int, float)):
            value = torch.tensor(float(value))
        else:
            raise TypeError(f"log({name!r}, value=...): expected a tensor or a number, got {type(value).__name__}")
        if value.numel() == 0:
            raise ValueError(f"log({name!r}, value=...): the tensor is empty")
        if value.numel() != 1:
            value = value.mean() if reduce == "mean" else getattr(value, reduce)()
        value = value.reshape(())
        if on_step:
            self._step[name] = (value, reduce)
            self._on_step.add(name)
        if on_epoch:
            entry = self._epoch.get(name)
            if entry is None:
                self._epoch[name] = [value.clone(), 1, reduce]
            elif reduce in ("mean", "sum"):
                entry[0] += value.to(entry[0].device)
                entry[1] += 1
            else:
                other = value.to(entry[0].device)
                entry[0] = torch.maximum(entry[0], other) if reduce == "max" else torch.minimum(entry[0], other)

    def state_dict(self) -> Dict[str, Any]:
        """Values not yet written (checkpointed so a mid-epoch resume reports the same metrics)."""
        return {
            "step": {name: [value.detach().cpu().clone(), reduce] for name, (value, reduce) in self._step.items()},
            "epoch": {name: [value.detach().cpu().clone(), count, reduce] for name, (value, count, reduce) in self._epoch.items()},
            "reductions": dict(self._reductions),
            "on_step": sorted(self._on_step),
        }

    def load_state_dict(self, state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore what :meth:`state_dict` returned, with tensors on ``device``."""
        self._step = {name: (value.to(device), reduce) for name, (value, reduce) in state["step"].items()}
        self._epoch = {name: [value.to(device), count, reduce] for name, (value, count, reduce) in state["epoch"].items()}
        self._reductions = dict(state["reductions"])
        self._on_step = set(state["on_step"])

    def pop_step(self) -> Dict[str, Tuple[torch.Tensor, str]]:
        """Latest step values (name -> (tensor, reduce)); clears them."""
        values, self._step = self._step, {}
        return dict(sorted(values.items()))

    def pop_epoch(self) -> Dict[str, Tuple[torch.Tensor, str]]:
        """Epoch aggregates (name -> (tensor, reduce)); clears them. A metric also logged
        ``on_step`` is named ``<name>_epoch`` here (as ``train_loss`` / ``train_loss_epoch``)."""
        aggregates, self._epoch = self._epoch, {}
        result = {}
        for name, (value, count, reduce) in sorted(aggregates.items()):
            key = f"{name}_epoch" if name in self._on_step else name
            result[key] = (value / count if reduce == "mean" else value, reduce)
        return result


def reduce_metrics(
    collected: Dict[str, Tuple[torch.Tensor, str]],
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor],
    device: Optional[torch.device] = None,
) -> Dict[str, float]:
    """Reduce collected values over ranks and read them back: one ``all_reduce`` and one
    host sync per reduction kind, however many metrics there are.

    Every rank must pass the same names (log the same metrics on every rank).

    Example:
        >>> reduce_metrics({"acc": (torch.tensor(0.5), "mean")}, lambda tensor, op: tensor)
        {'acc': 0.5}
    """
    by_reduction: Dict[str, List[str]] = {}
    for name, (_, reduce) in collected.items():
        by_reduction.setdefault(reduce, []).append(name)
    result: Dict[str, float] = {}
    for reduce, names in sorted(by_reduction.items()):
        stacked = torch.stack([collected[name][0].to(device) if device is not None else collected[name][0] for name in names])
        for name, value in zip(names, all_reduce(stacked, reduce).tolist()):
            result[name] = value
    return {name: result[name] for name in collected}


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
