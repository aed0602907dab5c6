"""Judge one cell: a backend's observations (one dict per rank) against the reference's."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from framework.conformance.registry import Feature


@dataclass
class Row:
    """One line of the conformance table: a cell (feature/model on some ranks) and its verdict.

    ``result`` is PASS, FAIL, REFUSED (declared unsupported by the backend and refused before
    step 1), KNOWN (a known seam, still failing: see ``KNOWN_SEAMS``), FIXED (a known seam that
    passes now: remove it from the list) or ERROR (the harness could not start the run: the
    backend could not be built on a rank, a ``--import`` failed; no verdict on the backend).
    """

    check: str
    ranks: int
    result: str
    figure: str
    tolerance: str

    @property
    def ok(self) -> bool:
        """Neither a failed cell nor a run the harness could not start."""
        return self.result not in ("FAIL", "ERROR")


RELATIVE = ("history", "validated")
"""Keys whose values span magnitudes (sums of per-sample errors, loss scales): compared relative to
the reference past 1 (``|got - want| / max(1, |want|)``), as summation order's error grows with the value."""


def _difference(got: Any, want: Any, relative: bool = False) -> float:
    """The largest entry-wise difference (inf when the shapes differ); ``relative``: divided by
    ``max(1, |want|)``.

    Example:
        >>> _difference([1.0, 200.0], [1.0, 200.002]), round(_difference([1.0, 200.0], [1.0, 200.002], relative=True), 7)
        (0.0020000000000095497, 1e-05)
    """
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return abs(float(got) - float(want))
    if not isinstance(got, list) or not isinstance(want, list) or len(got) != len(want):
        return float("inf")
    if not got:
        return 0.0
    mine, theirs = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    same = (mine == theirs) | (mine.isnan() & theirs.isnan())  # the same inf (a skipped step's loss) or both NaN
    gap = (mine - theirs).abs() / (theirs.abs().clamp(min=1.0) if relative else 1.0)
    return torch.where(same, torch.zeros_like(mine), gap).max().item()


def _error(observed: Dict[str, Any]) -> Optional[str]:
    value = observed.get("error")
    return value if isinstance(value, str) else None


Verdict = Tuple[bool, str]

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error", "stopped: rank")
"""What a rank's collective says when a peer's cell failed first (its group was then destroyed)."""


def _errors(ranks: List[Dict[str, Any]], reference: Dict[str, Any]) -> str:
    """Every rank's (and the reference's) error, the cause first: a rank's own error before the
    errors of peers whose collectives broke because of it; ``""`` when there is none."""
    found = [(f"rank {index}", _error(rank)) for index, rank in enumerate(ranks)] + [("reference", _error(reference))]
    errors = [(who, error) for who, error in found if error]
    errors.sort(key=lambda item: any(text in item[1] for text in _PEER_GONE))
    parts: List[str] = []
    for who, error in errors:
        if not any(error == seen.split(": ", 1)[-1] for seen in parts):
            parts.append(error if (who == "rank 0" and len(errors) == 1) else f"{who}: {error}")
    return "; ".join(parts)


def _compared(ranks: List[Dict[str, Any]], reference: Dict[str, Any], key: str, tolerance: float) -> Verdict:
    having = [rank for rank in ranks if key in rank]
    if key not in ranks[0] or key not in reference:
        return False, f"{key} missing ({'reference' if key not in reference else 'rank 0'})"
    relative = key in RELATIVE
    worst = max(_difference(rank[key], reference[key], relative) for rank in having)
    spread = max(_difference(rank[key], having[0][key]) for rank in having)
    shown = f"max |{key} - ref| / max(1, |ref|)" if relative else f"max |{key} - ref|"
    figure = f"{shown} = {worst:.2g}" + (f", ranks differ by {spread:.2g}" if spread else "")
    return worst <= tolerance and spread == 0.0, figure


def first_difference(got: Any, want: Any) -> str:
    """Where ``got`` first differs from ``want``: the index path and both values (lists and
    tuples entry by entry, so a long list shows the entry that differs, not a prefix).

    Example:
        >>> first_difference([0, 1, 2, 3], [0, 1, 5, 3])
        '[2]: 2 (ref: 5)'
        >>> first_difference([[4, "a"]], [[4, "b"], [6, "c"]])
        'length 1 (ref: 2); [0][1]: a (ref: b)'
    """
    prefix = ""
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            prefix = f"length {len(got)} (ref: {len(want)}); "
        for index, (mine, theirs) in enumerate(zip(got, want)):
            if mine != theirs:
                inner = first_difference(mine, theirs)
                return f"{prefix}[{index}]{'' if inner.startswith('[') else ': '}{inner}"
        if prefix:
            extra = got[len(want) :] or want[len(got) :]
            return f"{prefix}first extra entry: {str(extra[0])[:60]}"
    return f"{prefix}{str(got)[:60]} (ref: {str(want)[:60]})"


def _exact(ranks: List[Dict[str, Any]], reference: Dict[str, Any], key: str) -> Verdict:
    want = reference.get(key)
    got = [rank[key] for rank in ranks if key in rank]
    passed = key in ranks[0] and all(value == want for value in got)
    if passed:
        return True, f"{key}={str(got[0])[:60]}"
    if not got:
        scenario = key.partition(":")[0]  # a resume scenario that failed holds its error instead of its keys
        error = next((rank[scenario] for rank in ranks if isinstance(rank.get(scenario), str)), None)
        return False, f"{scenario}: {error}" if error else f"{key} missing (rank 0)"
    index, value = next((index, value) for index, value in enumerate(got) if value != want)
    where = f" on rank {index}" if index else ""
    if isinstance(value, (list, tuple)) and isinstance(want, (list, tuple)):
        return False, f"{key}{where} differs at {first_difference(value, want)}"
    return False, f"{key}{where} = {str(value)[:60]} (ref: {str(want)[:60]})"


def _resumed(ranks: List[Dict[str, Any]], key: str, tolerance: float) -> Verdict:
    """``key`` against the uninterrupted run's (``"abrupt:history"`` against ``"uninterrupted:history"``),
    or ``"a@b"``: the key ``a`` against the same run's key ``b``."""
    key, at, other = key.partition("@")
    for rank in ranks:
        if isinstance(rank.get(key), str):
            return False, f"{key}: {rank[key]}"
    _, colon, part = key.partition(":")
    baseline = other if at else "uninterrupted" + colon + part
    worst = max(_difference(rank.get(key), rank.get(baseline)) for rank in ranks)
    spread = max(_difference(rank.get(key), ranks[0].get(key)) for rank in ranks)
    shown = f"{key}: max |{key} - {other}|" if at else f"{key}: max |resumed - uninterrupted|"
    return worst <= tolerance and spread == 0.0, f"{shown} = {worst:.2g}" + (f", ranks differ by {spread:.2g}" if spread else "")


def _own_checks(ranks: List[Dict[str, Any]]) -> List[Verdict]:
    verdicts = []
    for rank_index, rank in enumerate(ranks):
        for label, passed, figure in rank.get("self", []):
            if not passed or rank_index == 0:
                verdicts.append((bool(passed), f"{figure}" + ("" if passed else f" (rank {rank_index}: {label})")))
    return verdicts


def judge(
    feature: Feature,
    cell: str,
    ranks: List[Dict[str, Any]],
    reference: Dict[str, Any],
    tolerance: float,
    resume_tolerance: float,
    declared: Optional[str] = None,
) -> Row:
    """The row for one cell from every rank's observations and the reference's."""
    shown = ("bitwise" if not tolerance else f"{tolerance:g}") if feature.compare else "exact"
    if feature.resumed:
        shown = "bitwise" if not resume_tolerance else f"{resume_tolerance:g}"
    size = len(ranks)
    harness = next((str(rank["harness"]) for rank in ranks if rank.get("harness")), None)
    if harness is not None:
        return Row(cell, size, "ERROR", f"the run never started (harness error): {harness}", shown)
    if declared is not None:
        refusals = [rank.get("refused") for rank in ranks]
        errors = [str(rank["error"]) for rank in ranks if _error(rank)]
        if errors or not all(refusals):
            return Row(cell, size, "FAIL", errors[0] if errors else "declared unsupported but not refused", "refused")
        return Row(cell, size, "REFUSED", f"{declared}: {refusals[0]}", "before step 1")
    failure = _errors(ranks, reference)
    if failure:
        return Row(cell, size, "FAIL", failure, shown)
    verdicts = _own_checks(ranks)
    verdicts += [_exact(ranks, reference, key) for key in feature.exact]
    verdicts += [_compared(ranks, reference, key, tolerance) for key in feature.compare]
    verdicts += [_resumed(ranks, key, resume_tolerance) for key in feature.resumed]
    failed = list(dict.fromkeys(figure for passed, figure in verdicts if not passed))  # a scenario's error once
    if failed:
        return Row(cell, size, "FAIL", "; ".join(failed), shown)
    numeric = [figure for _, figure in verdicts if "max |" in figure]
    worst = max(numeric, key=lambda figure: float(figure.split("= ")[1].split(",")[0]), default=None)
    return Row(cell, size, "PASS", worst or "; ".join(figure for _, figure in verdicts)[:100], shown)
