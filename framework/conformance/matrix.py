"""Which cells of the matrix run: the quick subset, everything, or a covering design over
backends for the test suite, with the cells the shapes target; and the known seams (cells expected to fail until a fix lands).

A cell is (feature, model) on a backend at a world size. ``--all`` runs every feature with every
model it takes; the default (quick) subset runs the quick features with the quick models, and
``automatic`` with every model. :func:`covering` spreads cells over several backends so that
every pair (feature, model), (feature, backend) and (model, backend) is covered at least once
(a greedy pairwise design with a fixed seed: the same cells every time).
"""

import fnmatch
import random
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from framework.conformance.registry import FEATURES, MODELS, QUICK_MODELS, TARGETED, TARGETS

Cell = Tuple[str, str]
"""(feature, model)."""

KNOWN_SEAMS: List[Tuple[str, str, str, str]] = []
"""Cells known to fail on today's main, each with the issue that tracks the fix:
(feature pattern, model pattern, backend pattern, reason); ``fnmatch`` patterns, alternatives
separated by ``|``, and a backend pattern may end in ``@2`` to match only the multi-rank run.
The kit reports such a cell as KNOWN while it fails and FIXED once it passes (the test suite
then fails until the entry is removed)."""


def _matches(name: str, patterns: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns.split("|"))


def known_seam(feature: str, model: str, backend: str, ranks: int) -> Optional[str]:
    """The reason a cell is a known seam, or None.

    Example:
        >>> KNOWN_SEAMS.append(("ema", "*", "fsdp*@2", "issue 31: an example"))
        >>> known_seam("ema", "mlp", "fsdp-amp", 2), known_seam("ema", "mlp", "fsdp", 1)
        ('issue 31: an example', None)
        >>> _ = KNOWN_SEAMS.pop()
    """
    for feature_pattern, model_pattern, backend_pattern, reason in KNOWN_SEAMS:
        names, _, only = backend_pattern.partition("@")
        if only and int(only) != ranks:
            continue
        if _matches(feature, feature_pattern) and _matches(model, model_pattern) and _matches(backend, names):
            return reason
    return None


def runs_at(feature: str, model: str, world_size: int) -> bool:
    """Whether the cell (feature, model) runs at ``world_size``: the feature runs there, and the
    model either computes as ``sp`` there or the feature compares the backend's numbers only with
    itself (a resume against the same backend's uninterrupted run, with the reference's resume step
    and checkpoint names: batch norm resumes at 2 ranks too).

    Example:
        >>> runs_at("resume_kill9", "batchnorm", 2), runs_at("automatic", "batchnorm", 2)
        (True, False)
    """
    spec = FEATURES[feature]
    self_compared = not spec.compare and bool(spec.resumed)  # exact keys of a resume (its step, its files) hold anywhere
    return world_size in spec.ranks and (world_size in MODELS[model].ranks or self_compared)


def sized_cells(cells: Sequence[Cell], sizes: Sequence[int]) -> List[Cell]:
    """The ``cells`` (each once, in order) that run at one of the world sizes ``sizes``: what
    ``--ranks`` runs (never a cell at a size it did not name).

    Example:
        >>> sized_cells([("automatic", "mlp"), ("automatic", "batchnorm"), ("compile", "mlp")], [4])
        [('automatic', 'mlp')]
    """
    return [cell for cell in dict.fromkeys(cells) if any(runs_at(*cell, size) for size in sizes)]


def models_of(feature: str) -> List[str]:
    """The zoo models ``feature`` runs with (a targeted shape: only with its targets' features)."""
    wanted = FEATURES[feature].models
    return [
        model
        for model in MODELS
        if (wanted is None or model in wanted)
        and (not TARGETED.get(model) or any(target == feature for target, _ in TARGETS[model]))
    ]


def targeted_cells(backend: str) -> List[Cell]:
    """The cells the shapes' targets add for ``backend`` (a layout only some backends can break,
    run where it matters; see ``register_model(targets=...)``).

    Example:
        >>> ("automatic", "tied-tp") in targeted_cells("model-parallel"), targeted_cells("sp")
        (True, [])
    """
    return [
        (feature, model) for model, targets in TARGETS.items() for feature, patterns in targets if _matches(backend, patterns)
    ]


def all_cells(features: Optional[Sequence[str]] = None, models: Optional[Sequence[str]] = None) -> List[Cell]:
    """Every feature (or those named) with every model it takes (or those named)."""
    chosen = _checked(features, FEATURES, "feature")
    shapes = _checked(models, MODELS, "model")
    return [(feature, model) for feature in chosen for model in models_of(feature) if model in shapes]


def quick_cells(features: Optional[Sequence[str]] = None, models: Optional[Sequence[str]] = None) -> List[Cell]:
    """The default subset: the quick features (or those named) with the quick shapes (or those
    named), and ``automatic`` with every shape.

    Example:
        >>> ("automatic", "per_rank_init") in quick_cells() and ("ema", "buffers") in quick_cells()
        True
        >>> quick_cells(["streams"])
        [('streams', 'mlp')]
    """
    chosen = _checked(features, FEATURES, "feature") if features else [name for name in FEATURES if FEATURES[name].quick]
    named = _checked(models, MODELS, "model") if models else None
    cells: List[Cell] = []
    for feature in chosen:
        takes = models_of(feature)
        if named is not None:
            shapes = [model for model in takes if model in named]
        elif feature == "automatic":
            shapes = takes
        else:
            shapes = [model for model in takes if QUICK_MODELS.get(model)] or takes[:1]
        cells += [(feature, model) for model in shapes]
    return cells


def covering(backends: Sequence[str], seed: int = 0, multi: Collection[str] = ()) -> Dict[str, List[Cell]]:
    """Cells per backend such that every (feature, model), (feature, backend) and (model,
    backend) pair is covered at least once (a feature registered with ``every_backend=False``
    only with each of its models): greedy, each step the candidate covering most new
    pairs (ties broken by a ``random.Random(seed)`` shuffle, so the design is fixed).

    For a backend in ``multi`` (multi-process), a (feature, backend) pair is covered only by a
    model that runs on 2 ranks: every feature of such a backend runs at 2 ranks somewhere. A
    single-process backend gets only cells that run on 1 rank."""
    multi = set(multi)
    candidates = [
        (feature, model, backend)
        for feature, model in all_cells()
        if not TARGETED.get(model)
        for backend in backends
        if backend in multi or runs_at(feature, model, 1)
    ]

    def pairs(candidate: Tuple[str, str, str]) -> Set[Tuple[str, str, str]]:
        feature, model, backend = candidate
        covered = {("fm", feature, model), ("mb", model, backend)}
        two_ranks = runs_at(feature, model, 2)
        if FEATURES[feature].every_backend and (backend not in multi or two_ranks or not _runs_at_two(feature)):
            covered.add(("fb", feature, backend))
        return covered

    uncovered: Set[Tuple[str, str, str]] = set()
    for candidate in candidates:
        uncovered |= pairs(candidate)
    generator = random.Random(seed)
    generator.shuffle(candidates)
    chosen: Dict[str, List[Cell]] = {backend: [] for backend in backends}
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        uncovered -= pairs(best)
        candidates.remove(best)
        chosen[best[2]].append((best[0], best[1]))
    order = {feature: index for index, feature in enumerate(FEATURES)}
    return {backend: sorted(cells, key=lambda cell: (order[cell[0]], cell[1])) for backend, cells in chosen.items()}


def _runs_at_two(feature: str) -> bool:
    """Whether ``feature`` takes any model that runs on 2 ranks (and runs there itself)."""
    return any(runs_at(feature, model, 2) for model in models_of(feature) if not TARGETED.get(model))


def _checked(names: Optional[Sequence[str]], known: Mapping[str, object], what: str) -> List[str]:
    if not names:
        return list(known)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; allowed: {', '.join(known)}")
    return list(names)
