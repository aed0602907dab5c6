"""Metric history (queryable, checkpointed) and the device-side collector behind ``module.log``."""

import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

_REDUCTIONS = ("mean", "sum", "max", "min")


class MetricHistory:
    """Every metric value a run recorded, in order.

    Example:
        >>> history = MetricHistory()
        >>> history.add("val_loss", 0.5, step=10, epoch=0)
        >>> history.add("val_loss", 0.4, step=20, epoch=1)
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
    tensor, epoch values as a running sum/max/min plus a count.

    Example:
        >>> collector = MetricCollector()
        >>> collector.log("acc", torch.tensor(0.5)); collector.log("acc", torch.tensor(1.0))
        >>> {name: float(value) for name, (value, _) in collector.pop_epoch().items()}
        {'acc': 0.75}
    """

    def __init__(self) -> None:
        self._step: Dict[str, Tuple[torch.Tensor, str]] = {}
        self._epoch: Dict[str, List[Any]] = {}

    def log(
        self, name: str, value: Union[torch.Tensor, float], on_step: bool = False, on_epoch: bool = True, reduce: str = "mean"
    ) -> None:
        if reduce not in _REDUCTIONS:
            raise ValueError(f"log({name!r}, reduce={reduce!r}): allowed reductions are {_REDUCTIONS}")
        value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        if value.numel() != 1:
            value = value.mean() if reduce == "mean" else getattr(value, reduce)()
        value = value.reshape(())
        if on_step:
            self._step[name] = (value, reduce)
        if on_epoch:
            entry = self._epoch.get(name)
            if entry is None:
                self._epoch[name] = [value.clone(), 1, reduce]
            elif reduce in ("mean", "sum"):
                entry[0] += value
                entry[1] += 1
            else:
                entry[0] = torch.maximum(entry[0], value) if reduce == "max" else torch.minimum(entry[0], value)

    def pop_step(self) -> Dict[str, Tuple[torch.Tensor, str]]:
        """Latest step values (name -> (tensor, reduce)); clears them."""
        values, self._step = self._step, {}
        return dict(sorted(values.items()))

    def pop_epoch(self) -> Dict[str, Tuple[torch.Tensor, str]]:
        """Epoch aggregates (name -> (tensor, reduce)); clears them."""
        aggregates, self._epoch = self._epoch, {}
        result = {}
        for name, (value, count, reduce) in sorted(aggregates.items()):
            result[name] = (value / count if reduce == "mean" else value, reduce)
        return result


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
