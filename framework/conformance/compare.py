"""Turn a backend's observations (one dict per rank) and the ``sp`` reference's into table rows."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class Row:
    """One line of the conformance table."""

    check: str
    ranks: int
    result: str  # PASS, FAIL or DECLARED (unsupported, declared by the backend)
    figure: str
    tolerance: str

    @property
    def ok(self) -> bool:
        return self.result in ("PASS", "DECLARED")


Verdict = Tuple[bool, str]
"""(passed, figure)."""


def _max_difference(got: Any, want: Any) -> float:
    if not isinstance(got, list) or not isinstance(want, list) or len(got) != len(want):
        return float("inf")
    return (torch.tensor(got) - torch.tensor(want)).abs().max().item() if got else 0.0


def _close(ranks: List[Dict[str, Any]], reference: Dict[str, Any], key: str, tolerance: float) -> Verdict:
    worst = max(_max_difference(rank.get(key), reference.get(key)) for rank in ranks)
    spread = max(_max_difference(rank.get(key), ranks[0].get(key)) for rank in ranks)
    figure = f"max |{key} - sp| = {worst:.2g}" + (f", ranks differ by {spread:.2g}" if spread else "")
    return worst <= tolerance and spread == 0.0, figure


def _error(observed: Dict[str, Any]) -> Optional[str]:
    """The error a check recorded instead of observations (None: it ran)."""
    value = observed.get("error")
    return value if isinstance(value, str) else None


@dataclass
class Feature:
    """A row: which check's observations it reads, and how it judges them."""

    name: str
    check: str
    judge: Callable[[List[Dict[str, Any]], Dict[str, Any], float], Verdict]
    tolerance: Callable[[float, float], float]  # (parameter tolerance, resume tolerance) -> this row's
    described: str  # how the tolerance reads in the table


def _params(key: str = "params") -> Callable[[List[Dict[str, Any]], Dict[str, Any], float], Verdict]:
    return lambda ranks, reference, tolerance: _close(ranks, reference, key, tolerance)


def _dtype(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    dtypes = sorted({str(rank.get("dtype")) for rank in ranks})
    return dtypes == [str(reference.get("dtype"))], f"train_step computes in {', '.join(dtypes)}"


def _setup(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    seen = [rank.get("setup") for rank in ranks]
    expected = [[rank, len(ranks)] for rank in range(len(ranks))]
    return seen == expected, f"setup() saw (global_rank, world_size) = {seen}"


def _order(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    orders = [rank.get("val_order") for rank in ranks]
    main = ranks[0]
    in_order = all(order == reference.get("val_order") == list(range(21)) for order in orders)
    predicted = main.get("predict_index") == reference.get("predict_index") == list(range(21))
    worst = _max_difference(main.get("predictions"), reference.get("predictions"))
    passed = in_order and predicted and worst <= tolerance
    return passed, f"val/predict order {'kept' if in_order and predicted else 'WRONG'}, max |prediction - sp| = {worst:.2g}"


def _metric(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    """``val_weighted`` from validate() and test() (the same loaders) against sp's."""
    values = [rank.get(key) for rank in ranks for key in ("val_weighted", "test_weighted")]
    wanted = [reference.get(key) for _ in ranks for key in ("val_weighted", "test_weighted")]
    if any(value is None for value in values + wanted):
        return False, f"val/test_weighted missing: {values}"
    worst = max(abs(float(value or 0.0) - float(want or 0.0)) for value, want in zip(values, wanted))
    return worst <= tolerance, f"max |val/test_weighted - sp| = {worst:.2g} (21 samples, uneven batches)"


def _equal(*keys: str) -> Callable[[List[Dict[str, Any]], Dict[str, Any], float], Verdict]:
    def judge(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
        got = [tuple(rank.get(key) for key in keys) for rank in ranks]
        want = tuple(reference.get(key) for key in keys)
        passed = all(item == want for item in got) and None not in want
        return passed, ", ".join(f"{key}={got[0][index]}" for index, key in enumerate(keys)) + (
            "" if passed else f" (sp: {want})"
        )

    return judge


def _resumed(key: str) -> Callable[[List[Dict[str, Any]], Dict[str, Any], float], Verdict]:
    def judge(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
        for rank in ranks:
            if isinstance(rank.get(key), str):
                return False, rank[key]
        worst = max(_max_difference(rank.get(key), rank.get("uninterrupted")) for rank in ranks)
        return worst <= tolerance, f"max |resumed - uninterrupted| = {worst:.2g}"

    return judge


def _covered(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    shares: Dict[Any, List[Any]] = {}  # ranks of one data-parallel rank (tensor-parallel peers) read the same share
    for index, rank in enumerate(ranks):
        share = shares.setdefault(rank.get("data_parallel_rank", index), rank.get("seen", []))
        if share != rank.get("seen", []):
            return False, f"ranks of data-parallel rank {rank.get('data_parallel_rank')} saw different samples"
    seen = sorted(index for share in shares.values() for index in share)
    wanted = sorted(reference.get("seen", []))
    return seen == wanted == list(range(64)), f"{len(seen)} samples seen over the ranks, {len(set(seen))} distinct (of 64)"


_PARAMS = "parameter tolerance"
FEATURES: List[Feature] = [
    Feature("automatic optimization, derived accumulation, clipping", "automatic", _params(), lambda p, r: p, _PARAMS),
    Feature("module setup() knows rank and world size", "automatic", _setup, lambda p, r: 0.0, "exact"),
    Feature("precision: train_step's compute dtype", "automatic", _dtype, lambda p, r: 0.0, "same as sp"),
    Feature("manual optimization, two optimizers", "manual", _params(), lambda p, r: p, _PARAMS),
    Feature("validate/test/predict in dataset order", "evaluation", _order, lambda p, r: p, _PARAMS),
    Feature("batch-size-weighted metrics", "evaluation", _metric, lambda p, r: p, _PARAMS),
    Feature("early stopping", "early_stopping", _equal("epochs", "steps"), lambda p, r: 0.0, "exact"),
    Feature("NaN loss stops the run", "nan_stop", _equal("step"), lambda p, r: 0.0, "exact"),
    Feature("SIGTERM preemption, resume", "resume", _resumed("sigterm"), lambda p, r: r, "resume tolerance"),
    Feature("abrupt stop (kill -9 stand-in), resume", "resume", _resumed("abrupt"), lambda p, r: r, "resume tolerance"),
    Feature("damaged checkpoint: fall back, resume", "resume", _resumed("damaged"), lambda p, r: r, "resume tolerance"),
    Feature('evaluation from "best"', "best", _equal("best"), lambda p, r: 0.0, "exact"),
    Feature('metric of validate("best")', "best", lambda ranks, ref, t: _metric_value(ranks, ref, t), lambda p, r: p, _PARAMS),
    Feature("loader workers, global-RNG augmentation", "workers", _params(), lambda p, r: p, _PARAMS),
    Feature("stream split by rank and worker", "streams", _covered, lambda p, r: 0.0, "exact"),
]
"""The table's rows, in order; several rows may read one check's observations."""


def _metric_value(ranks: List[Dict[str, Any]], reference: Dict[str, Any], tolerance: float) -> Verdict:
    values = [rank.get("val_weighted") for rank in ranks]
    want = reference.get("val_weighted")
    if want is None or any(value is None for value in values):
        return False, f"val_weighted missing: {values}"
    worst = max(abs(value - want) for value in values)
    return worst <= tolerance, f"max |val_weighted - sp| = {worst:.2g}"


def judge(
    feature: Feature,
    ranks: List[Dict[str, Any]],
    reference: Dict[str, Any],
    parameter_tolerance: float,
    resume_tolerance: float,
    declared: Dict[str, str],
) -> Row:
    """The row for ``feature`` from every rank's observations of its check."""
    tolerance = feature.tolerance(parameter_tolerance, resume_tolerance)
    shown = feature.described if feature.described in ("exact", "same as sp") else f"{tolerance:g}" if tolerance else "bitwise"
    if feature.check in declared:
        return Row(feature.name, len(ranks), "DECLARED", f"unsupported: {declared[feature.check]}", "-")
    for observed in (*ranks, reference):
        error = _error(observed.get(feature.check, {"error": "not run"}))
        if error:
            return Row(feature.name, len(ranks), "FAIL", error, shown)
    passed, figure = feature.judge([rank[feature.check] for rank in ranks], reference[feature.check], tolerance)
    return Row(feature.name, len(ranks), "PASS" if passed else "FAIL", figure, shown)
