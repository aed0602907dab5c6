"""Metric history (queryable, checkpointed) and the device-side collector behind ``module.log``."""

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

_REDUCTIONS = ("mean", "sum", "max", "min")
FRAMEWORK_SERIES = {
    "train_loss": "the mean training loss between log points",
    "train_loss_epoch": "the epoch's mean training loss",
}
"""Names the framework records itself during training; a ``self.log`` of one replaces the framework's
series (with a warning). ``val_loss``/``test_loss`` logged in a step replace the returned loss's silently."""


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

    def names(self) -> List[str]:
        """Metric names in first-seen order."""
        return list(dict.fromkeys(record["name"] for record in self.records))

    def __len__(self) -> int:
        return len(self.records)

    def state_dict(self) -> Dict[str, Any]:
        return {"records": [dict(record) for record in self.records]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.records = [dict(record) for record in state["records"]]


class Logged(NamedTuple):
    """One collected metric: its value, how it is reduced, and its weight.

    For ``mean`` the value is the weighted mean on this rank and ``weight`` the total weight
    (samples) behind it, so ranks combine into the mean over every sample; other reductions
    ignore the weight.
    """

    value: torch.Tensor
    reduce: str
    weight: float = 1.0


def infer_batch_size(batch: Any) -> int:
    """The size of ``batch`` as Lightning infers it: the first tensor's first dimension
    (a 0-d tensor or a batch without tensors counts as 1).

    Example:
        >>> infer_batch_size({"x": torch.ones(8, 3), "y": torch.ones(8)})
        8
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items: Any = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return 1
    for item in items:
        if _holds_tensor(item):
            return infer_batch_size(item)
    return 1


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_tensor(getattr(obj, field.name)) for field in dataclasses.fields(obj))
    if isinstance(obj, Mapping):
        return any(_holds_tensor(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(value) for value in obj)
    return False


class MetricCollector:
    """Collects ``module.log(...)`` values on the device until the trainer writes them.

    Nothing here reads a tensor back to the host: step values are kept as the latest
    tensor, epoch values as a running weighted mean, sum, max or min. A ``mean`` is weighted
    by the batch size (``batch_size=``, else inferred from the batch of the step being run:
    its first tensor's first dimension; 1 outside a step), so the epoch value is the mean over
    samples whatever the batch sizes. Floating values keep their dtype (float64 stays float64);
    a Python number becomes a tensor of the default dtype on the CPU.

    Example:
        >>> collector = MetricCollector()
        >>> collector.log("acc", torch.tensor(0.5), batch_size=1); collector.log("acc", torch.tensor(1.0), batch_size=3)
        >>> {name: float(logged.value) for name, logged in collector.pop_epoch().items()}
        {'acc': 0.875}
    """

    def __init__(self) -> None:
        self._step: Dict[str, Logged] = {}
        self._epoch: Dict[str, List[Any]] = {}
        self._reductions: Dict[str, str] = {}
        self._on_step: set = set()
        self._objects: Dict[str, Any] = {}  # torchmetrics Metric objects, computed and reset at the epoch's end
        self.batch: Any = None  # the batch of the step being run (set by the step dispatcher)
        self.claimed: set = set()  # the series names the user's logs produce (kept across epochs)

    def log(
        self,
        name: str,
        value: Union[torch.Tensor, float, Any],
        on_step: bool = False,
        on_epoch: bool = True,
        reduce: str = "mean",
        batch_size: Optional[int] = None,
    ) -> None:
        """Keep ``value`` (a tensor with one or more elements, a number, or a torchmetrics
        ``Metric``) under ``name``.

        A tensor with several elements is first reduced with ``reduce`` (``mean`` of a
        per-sample tensor, etc.). ``batch_size`` weights a ``mean`` (default: inferred from
        the current batch). A ``Metric`` object is kept, not read: the user updates it in the
        step; :meth:`pop_epoch` calls its ``compute()`` (which torchmetrics syncs over ranks)
        and then ``reset()``. With ``on_step`` its last ``forward`` value (the batch's) is the
        step value.

        Raises:
            ValueError: an empty name, an unknown ``reduce``, a ``reduce`` that differs from
                an earlier call for the same name, ``on_step`` and ``on_epoch`` both off, or a
                negative ``batch_size``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"log(name={name!r}): the name must be a non-empty string")
        if reduce not in _REDUCTIONS:
            raise ValueError(f"log({name!r}, reduce={reduce!r}): allowed reductions are {_REDUCTIONS}")
        if not (on_step or on_epoch):
            raise ValueError(f"log({name!r}, on_step=False, on_epoch=False) would record nothing; set one of them")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0):
            raise ValueError(f"log({name!r}, batch_size={batch_size!r}): allowed: an integer >= 0, or None to infer it")
        if name not in self.claimed or (on_step and on_epoch):
            self._claim((name, name + "_epoch") if on_step and on_epoch else (name,))
        if is_metric_object(value):
            self._log_metric_object(name, value, on_step, on_epoch)
            return
        previous = self._reductions.setdefault(name, reduce)
        if previous != reduce:
            raise ValueError(f"log({name!r}, reduce={reduce!r}): this metric was logged with reduce={previous!r}")
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if hasattr(tensor, "full_tensor"):  # a DTensor (a sharded model's norm): its value on every rank
                tensor = tensor.full_tensor()
            if not tensor.is_floating_point():
                tensor = tensor.to(torch.get_default_dtype())
        elif isinstance(value, (int, float)):
            tensor = torch.tensor(float(value))
        else:
            raise TypeError(
                f"log({name!r}, value=...): expected a tensor, a number or a torchmetrics Metric, got {type(value).__name__}"
            )
        if tensor.numel() == 0:
            raise ValueError(f"log({name!r}, value=...): the tensor is empty")
        if tensor.numel() != 1:
            tensor = tensor.mean() if reduce == "mean" else getattr(tensor, reduce)()
        value = tensor.reshape(())
        weight = 1.0
        if reduce == "mean":
            weight = float(batch_size if batch_size is not None else (1 if self.batch is None else infer_batch_size(self.batch)))
        if on_step:
            self._step[name] = Logged(value, reduce, weight)
            self._on_step.add(name)
        if on_epoch:
            self._accumulate(name, value, reduce, weight)

    def _claim(self, names: Tuple[str, ...]) -> None:
        for produced in names:
            if produced in self.claimed:
                continue
            self.claimed.add(produced)
            if produced in FRAMEWORK_SERIES:
                warnings.warn(
                    f"self.log({names[0]!r}) records the series {produced!r}, a name the framework records itself "
                    f"({FRAMEWORK_SERIES[produced]}): your values replace the framework's under that name (one series); "
                    "log under another name to keep both",
                    UserWarning,
                    stacklevel=4,
                )

    def _log_metric_object(self, name: str, metric: Any, on_step: bool, on_epoch: bool) -> None:
        previous = self._reductions.setdefault(name, _METRIC_OBJECT)
        if previous != _METRIC_OBJECT:
            raise ValueError(f"log({name!r}, <Metric>): this name was logged with plain values (reduce={previous!r})")
        known = self._objects.get(name)
        if known is not None and known is not metric:
            raise ValueError(f"log({name!r}, <Metric>): this name was logged with another Metric object")
        if on_epoch:
            self._objects[name] = metric
        cached = getattr(metric, "_forward_cache", None)
        if on_step and isinstance(cached, torch.Tensor) and cached.numel() == 1:
            weight = float(1 if self.batch is None else infer_batch_size(self.batch))
            self._step[name] = Logged(_as_float(cached.detach()).reshape(()), "mean", weight)
        if on_step:
            self._on_step.add(name)

    def _accumulate(self, name: str, value: torch.Tensor, reduce: str, weight: float) -> None:
        entry = self._epoch.get(name)
        if entry is None:
            self._epoch[name] = [value * weight if reduce == "mean" else value.clone(), weight, reduce]
            return
        other = value.to(entry[0].device)
        if reduce == "mean":
            entry[0] = entry[0] + other * weight
            entry[1] += weight
        elif reduce == "sum":
            entry[0] = entry[0] + other
        else:
            entry[0] = torch.maximum(entry[0], other) if reduce == "max" else torch.minimum(entry[0], other)

    def state_dict(self) -> Dict[str, Any]:
        """Values not yet written (checkpointed so a mid-epoch resume reports the same metrics)."""
        return {
            "step": {
                name: [logged.value.detach().cpu().clone(), logged.reduce, logged.weight] for name, logged in self._step.items()
            },
            "epoch": {
                name: [value.detach().cpu().clone(), weight, reduce] for name, (value, weight, reduce) in self._epoch.items()
            },
            "reductions": dict(self._reductions),
            "on_step": sorted(self._on_step),
        }

    def load_state_dict(self, state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore what :meth:`state_dict` returned, with tensors on ``device``. Metric objects
        logged since then are reset (their state is not part of the snapshot)."""
        self.reset_metric_objects()
        self._step = {name: Logged(entry[0].to(device), entry[1], *entry[2:]) for name, entry in state["step"].items()}
        self._epoch = {name: [value.to(device), weight, reduce] for name, (value, weight, reduce) in state["epoch"].items()}
        self._reductions = dict(state["reductions"])
        self._on_step = set(state["on_step"])

    def reset_metric_objects(self) -> None:
        """``reset()`` every Metric object logged since the last :meth:`pop_epoch` and forget it
        (after a sanity check or a batch-size probe: their updates must not count)."""
        objects, self._objects = self._objects, {}
        for metric in objects.values():
            metric.reset()

    def pop_step(self) -> Dict[str, Logged]:
        """Latest step values (name -> :class:`Logged`); clears them."""
        values, self._step = self._step, {}
        return dict(sorted(values.items()))

    def pop_epoch(self, all_gather_object: Optional[Callable[[Any], List[Any]]] = None) -> Dict[str, Logged]:
        """Epoch aggregates (name -> :class:`Logged`); clears them. A metric also logged
        ``on_step`` is named ``<name>_epoch`` here (as ``train_loss`` / ``train_loss_epoch``).

        Args:
            all_gather_object: with several ranks, the ranks' gather: they first agree on the
                Metric objects whose ``compute()`` syncs over ranks (one object gather).

        Raises:
            MetricNotLoggedOnEveryRank: on every rank, when some rank did not log a Metric
                object the others did (its ``compute()`` would wait for that rank forever).
        """
        aggregates, self._epoch = self._epoch, {}
        objects, self._objects = self._objects, {}
        if all_gather_object is not None:
            _agree_on_synced_objects(objects, all_gather_object)
        result = {}
        for name, metric in sorted(objects.items()):  # the same order on every rank: compute() syncs
            value = metric.compute()
            metric.reset()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"log({name!r}, <Metric>): compute() must give one number, got {value!r}")
            key = f"{name}_epoch" if name in self._on_step else name
            result[key] = Logged(_as_float(value.detach()).reshape(()), "max")  # already over ranks: max keeps it exact
        for name, (value, weight, reduce) in aggregates.items():
            key = f"{name}_epoch" if name in self._on_step else name
            if reduce == "mean":
                result[key] = Logged(value / weight if weight else value, reduce, weight)
            else:
                result[key] = Logged(value, reduce)
        return dict(sorted(result.items()))


_METRIC_OBJECT = "Metric object"


class MetricNotLoggedOnEveryRank(RuntimeError):
    """A torchmetrics ``Metric`` that syncs over ranks was logged on some ranks and not others;
    raised on every rank at the epoch's end, before any ``compute()``.

    Example:
        try:
            trainer.train()
        except MetricNotLoggedOnEveryRank as error:
            print(error)  # names the metric and the ranks that did not log it
    """


def _agree_on_synced_objects(objects: Mapping[str, Any], all_gather_object: Callable[[Any], List[Any]]) -> None:
    """Raise :class:`MetricNotLoggedOnEveryRank` on every rank unless every rank logged the same
    syncing Metric objects (``sync_on_compute``, torchmetrics' default; one that does not sync
    may be logged on one rank alone)."""
    synced = sorted(name for name, metric in objects.items() if getattr(metric, "sync_on_compute", True))
    per_rank = all_gather_object(synced)
    if all(names == synced for names in per_rank):
        return
    missing = {}
    for name in sorted({name for names in per_rank for name in names}):
        absent = [rank for rank, names in enumerate(per_rank) if name not in names]
        if absent:
            missing[name] = absent
    described = "; ".join(f"{name!r} not on rank(s) {ranks}" for name, ranks in missing.items())
    raise MetricNotLoggedOnEveryRank(
        f"self.log(name, <Metric>) this epoch on some ranks only: {described}. A torchmetrics Metric's compute() "
        "syncs its state over every rank, so the ranks that logged it would wait forever for the others. Log it on "
        "every rank (also where a rank saw no batch: log it in on_end_*_epoch), or create it with "
        "sync_on_compute=False to log per-rank values"
    )


def is_metric_object(value: Any) -> bool:
    """True for a torchmetrics ``Metric`` (or anything with ``update``, ``compute`` and ``reset``
    methods that is an ``nn.Module``), without importing torchmetrics.

    Example:
        >>> is_metric_object(torch.tensor(1.0)), is_metric_object(torch.nn.Linear(1, 1))
        (False, False)
    """
    return isinstance(value, torch.nn.Module) and all(
        callable(getattr(value, name, None)) for name in ("update", "compute", "reset")
    )


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_floating_point() else tensor.to(torch.get_default_dtype())


_IDENTITY = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}


def reduce_metrics(
    collected: Mapping[str, Tuple[Any, ...]],
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor],
    device: Optional[torch.device] = None,
    all_gather_object: Optional[Callable[[Any], List[Any]]] = None,
) -> Dict[str, float]:
    """Reduce collected values over ranks and read them back: one ``all_reduce`` and one
    host sync per reduction kind, however many metrics there are.

    ``collected`` maps names to :class:`Logged` (or ``(value, reduce)`` pairs, weight 1). A
    ``mean`` is weighted: the sum of ``value * weight`` over ranks divided by the sum of the
    weights, so it is the mean over every sample on any world size. Values are reduced in
    their promoted dtype (float64 stays float64).

    Without ``all_gather_object`` every rank must pass the same names. With it, the ranks
    first agree on the union of their names (one object gather), and a rank that logged
    nothing (no evaluation batch) joins with neutral values instead of leaving the others
    waiting.

    Example:
        >>> reduce_metrics({"acc": Logged(torch.tensor(0.5), "mean", 4.0)}, lambda tensor, op: tensor)
        {'acc': 0.5}
    """
    entries = {name: Logged(*entry) for name, entry in collected.items()}
    if all_gather_object is not None:
        specs: Dict[str, Tuple[str, str]] = {}
        for rank_specs in all_gather_object({name: (entry.reduce, str(entry.value.dtype)) for name, entry in entries.items()}):
            for name, spec in rank_specs.items():
                specs.setdefault(name, spec)
        for name, (reduce, dtype_name) in sorted(specs.items()):
            if name not in entries:
                neutral = torch.tensor(_IDENTITY[reduce], dtype=getattr(torch, dtype_name.replace("torch.", "")), device=device)
                entries[name] = Logged(neutral, reduce, 0.0)
        entries = dict(sorted(entries.items()))
    by_reduction: Dict[str, List[str]] = {}
    for name, entry in entries.items():
        by_reduction.setdefault(entry.reduce, []).append(name)
    result: Dict[str, float] = {}
    for reduce, names in sorted(by_reduction.items()):
        values = [entries[name].value.to(device) if device is not None else entries[name].value for name in names]
        dtype = functools.reduce(torch.promote_types, [value.dtype for value in values])
        stacked = torch.stack([value.to(dtype) for value in values])
        if reduce == "mean":
            weights = torch.tensor([entries[name].weight for name in names], dtype=dtype, device=stacked.device)
            sums = all_reduce(torch.stack([stacked * weights, weights]), "sum")
            reduced = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(torch.finfo(dtype).tiny), stacked)
        else:
            reduced = all_reduce(stacked, reduce)
        for name, value in zip(names, reduced.tolist()):
            result[name] = value
    return {name: result[name] for name in entries}
