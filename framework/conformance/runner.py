"""Run the matrix for one backend: the reference (``sp`` with the backend's precision) in this
process, the backend on 1 rank here and on 2 ranks in one process group (gloo on CPU, NCCL
where there is a GPU per rank) that runs every cell in sequence."""

import os
import tempfile
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from backends import SingleProcess, TrainerBackend, available_backends, build_backend
from backends.registry import _registry
from framework.conformance.checks import Cell, Context, cell_key, run_cells
from framework.conformance.compare import Row, judge
from framework.conformance.layouts import describe_layout
from framework.conformance.matrix import known_seam, quick_cells, runs_at, targeted_cells
from framework.conformance.ranks import import_plugin, run_ranks
from framework.conformance.references import SCALED_REFERENCE
from framework.conformance.registry import FEATURES

FP32_TOLERANCE = 1e-5
"""Largest difference from the reference allowed in fp32 on several ranks: summation order only."""
LOWER_PRECISION_TOLERANCE = 5e-2
"""The same when the backend computes in bf16/fp16: rounding differs per layout."""
_ONE_CPU_PROCESS = SimpleNamespace(use_gpu=False, cluster="local")
"""Backend options for looking at a backend in the kit's own process: CPU, no launcher."""


def built_in_backends() -> List[str]:
    """Backends registered by the ``backends`` package itself (plugins and tests' own excluded).

    Only the package and its submodules count (``backends``, ``backends.*``): a plugin module
    whose name merely starts with the word (``backends_x``) is third-party.
    """
    return [name for name in available_backends() if _is_built_in(getattr(_registry[name], "__module__", None) or "")]


def _is_built_in(module: str) -> bool:
    """True for the ``backends`` package and its submodules, not for ``backends_x`` or ``backendsfoo``."""
    return module == "backends" or module.startswith("backends.")


def reference_backend(backend: str) -> str:
    """The backend ``backend`` is compared with: the one it declares
    (``TrainerBackend.conformance_reference``), else :data:`SCALED_REFERENCE` for a precision with
    a GradScaler, else the built-in single-process backend with its precision (the closest
    precision class): ``sp`` for fp32, ``sp-amp`` for autocast, ``sp-bf16`` for true bf16.

    Raises:
        ValueError: the declared reference is not a registered backend.
    """
    instance = build_backend(backend, _ONE_CPU_PROCESS)
    declared = getattr(instance, "conformance_reference", None)
    if declared is not None:
        if declared not in available_backends():
            raise ValueError(
                f"backend {backend!r} declares conformance_reference={declared!r}, which is not registered; "
                f"registered: {', '.join(available_backends())}"
            )
        return str(declared)
    if _precision_of(backend)[1]:
        return SCALED_REFERENCE
    precision = type(instance.precision)
    candidates: Dict[type, str] = {}
    for name in sorted(built_in_backends(), key=len):
        try:
            candidate = build_backend(name, _ONE_CPU_PROCESS)
        except Exception:  # a plugin that cannot be built here is no candidate
            continue
        if type(candidate.strategy) is SingleProcess and type(candidate) is TrainerBackend:
            candidates.setdefault(type(candidate.precision), name)
    for cls in precision.__mro__:
        if cls in candidates:
            return candidates[cls]
    return "sp"


def _precision_of(backend: str) -> Tuple[Optional[torch.dtype], bool]:
    """What ``backend``'s precision computes in on CPU (None: fp32), and whether it scales the
    loss (a GradScaler: steps with inf/NaN gradients are skipped)."""
    instance = build_backend(backend, _ONE_CPU_PROCESS)
    instance.setup()
    try:
        return instance.compute_dtype, bool(instance.skips_nonfinite_steps)
    finally:
        instance.teardown()


def compute_dtype(backend: str) -> Optional[torch.dtype]:
    """What ``backend``'s precision computes in on CPU (None: fp32)."""
    return _precision_of(backend)[0]


def declared_dtype(backend: str) -> Optional[str]:
    """The compute dtype ``backend`` declares (``TrainerBackend.conformance_compute_dtype``), or None."""
    declared = getattr(build_backend(backend, _ONE_CPU_PROCESS), "conformance_compute_dtype", None)
    return None if declared is None else str(declared).replace("torch.", "")


def lower_precision(backend: str) -> Tuple[bool, bool]:
    """(whether ``backend`` computes in less than fp32 or is compared with a lower-precision
    reference, whether it declares a compute dtype unlike its reference's: then no world size is
    bitwise)."""
    reference = reference_backend(backend)
    own = declared_dtype(backend)
    lower = compute_dtype(backend) is not None or reference != "sp" or own not in (None, "float32")
    return lower, own is not None


ReferenceCache = Dict[Tuple[str, str], Dict[str, Any]]
"""Reference observations by (reference backend, cell key), shared by several backends' runs."""


def reference_observations(name: str, cells: List[Cell], workdir: str, cache: ReferenceCache) -> Dict[str, Any]:
    """The reference backend ``name``'s observations of ``cells`` (run here, once: ``cache`` keeps them)."""
    missing = [cell for cell in cells if (name, cell_key(*cell)) not in cache]
    if missing:
        context = Context(name, os.path.join(workdir, "reference"), shared=workdir)
        for key, observed in run_cells(context, missing).items():
            cache[(name, key)] = observed
    return {cell_key(*cell): cache[(name, cell_key(*cell))] for cell in cells}


def conformance(
    backend: str,
    imports: Sequence[str] = (),
    world_sizes: Optional[Sequence[int]] = None,
    cells: Optional[Sequence[Cell]] = None,
    workdir: Optional[str] = None,
    timeout: float = 600.0,
    reference_cache: Optional[ReferenceCache] = None,
    names: Optional[Sequence[str]] = None,
) -> List[Row]:
    """Run ``cells`` (default: the quick subset and the cells the shapes target on ``backend``)
    against ``backend``; return the table's rows.

    ``names`` (deprecated: the old check names) selects features. ``world_sizes``: 1 runs in
    this process; more spawns the ranks (only for a multi-process backend); None: 1 and 2 for a
    multi-process backend, 1 for a single-process one. A cell that needs the 1-rank run (the
    world-size change) also runs on 1 rank when only 2 are asked.

    Raises:
        ValueError: a world size the backend cannot run (more than 1 for a single-process
            backend, less than 1), or one at which none of ``cells`` runs: the kit runs what it
            is asked or refuses, it never reports a smaller run as the one asked for.
    """
    for name in imports:
        import_plugin(name)
    if cells is None:  # the quick subset, and the cells the targeted shapes add on this backend
        quick = quick_cells(_renamed(names) if names else None)
        cells = shapes_of(backend, quick + ([cell for cell in targeted_cells(backend) if cell not in quick] if not names else []))
    cells = list(cells)
    instance = build_backend(backend)
    declared = instance.declared_unsupported_features
    reference_name = reference_backend(backend)
    multi = instance.multi_process
    lower, own_dtype = lower_precision(backend)
    world_sizes = checked_world_sizes(backend, multi, cells, world_sizes)
    workdir = workdir or tempfile.mkdtemp(prefix="conformance-")
    cache: ReferenceCache = reference_cache if reference_cache is not None else {}
    reference = reference_observations(reference_name, [cell for cell in cells if cell[0] not in declared], workdir, cache)
    if own_dtype:  # a precision unlike its reference's: its steps compute in the dtype it declares
        reference = with_dtype(reference, declared_dtype(backend) or "")
    rows: List[Row] = []

    def elsewhere(cell: Cell) -> bool:  # run on 1 rank although 1 was not asked: the handover, or no asked size runs it
        return cell[0] == "world_size_change" or not any(runs_at(*cell, size) for size in world_sizes)

    needs_one = any(elsewhere(cell) for cell in cells)
    for world_size in sorted(set(world_sizes) | ({1} if multi and needs_one else set())):
        sized = [cell for cell in cells if runs_at(*cell, world_size)]
        if world_size > 1 and not multi:
            continue  # a single-process strategy refuses multi-process launches
        if world_size == 1 and 1 not in world_sizes:  # only what the larger world sizes cannot run
            sized = [cell for cell in sized if elsewhere(cell)]
        context = Context(backend, os.path.join(workdir, f"ranks{world_size}"), shared=workdir, declared=declared)
        if world_size == 1:
            ranks = [reference] if backend == reference_name else [run_cells(context, sized)]
        else:
            ranks = run_ranks(context, sized, list(imports), world_size, timeout)
        rows += judge_cells(backend, sized, ranks, reference, world_size, lower, own_dtype)
    return rows


def shapes_of(backend: str, cells: Sequence[Cell]) -> List[Cell]:
    """``cells`` with only the shapes ``backend`` declares it trains (``conformance_shapes``: a pipeline
    row trains only a shape that defines ``pipeline_inputs``/``pipeline_loss``); all of them when it declares none.

    Example:
        >>> import framework.conformance  # registers the pipeline rows
        >>> shapes_of("fsdp-pp", [("automatic", "mlp"), ("automatic", "pipeline")]), shapes_of("fsdp", [("automatic", "mlp")])
        ([('automatic', 'pipeline')], [('automatic', 'mlp')])
    """
    shapes = declared_shapes(backend)
    return [cell for cell in cells if cell[1] in shapes] if shapes else list(cells)


def declared_shapes(backend: str) -> Optional[List[str]]:
    """The shapes ``backend`` declares it trains (``TrainerBackend.conformance_shapes``), or None: every one.
    A backend not registered here (a plugin its ranks import) declares none."""
    try:
        shapes = getattr(build_backend(backend), "conformance_shapes", None)
    except ValueError:
        return None
    return list(shapes) if shapes else None


def checked_world_sizes(backend: str, multi: bool, cells: Sequence[Cell], world_sizes: Optional[Sequence[int]]) -> List[int]:
    """The world sizes to run: ``world_sizes`` when the backend can run each and some cell runs
    at each; None: (1, 2) for a multi-process backend, (1,) otherwise.

    Example:
        >>> checked_world_sizes("sp", False, [("automatic", "mlp")], None)
        [1]
        >>> checked_world_sizes("ddp", True, [("automatic", "mlp")], [4])
        [4]
        >>> checked_world_sizes("ddp", True, [("automatic", "mlp")], [3])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --ranks 3: none of the 1 selected cell(s) runs at 3 ranks (the features run at 1, 2, 4 ranks); ...
    """
    if world_sizes is None:
        return [1, 2] if multi else [1]
    sizes = sorted(set(world_sizes))
    bad = [size for size in sizes if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if bad or not sizes:
        raise ValueError(f"--ranks {','.join(map(str, world_sizes))}: world sizes must be integers >= 1")
    if not multi and sizes != [1]:
        raise ValueError(f"--ranks {','.join(map(str, sizes))}: backend {backend!r} is single-process; allowed: 1")
    possible = sorted({size for feature, _ in cells for size in FEATURES[feature].ranks})
    for size in sizes:
        if not any(runs_at(feature, model, size) for feature, model in cells):
            raise ValueError(
                f"--ranks {size}: none of the {len(cells)} selected cell(s) runs at {size} ranks (the features run at "
                f"{', '.join(map(str, possible))} ranks); allowed here: "
                f"{', '.join(str(n) for n in possible if any(runs_at(f, m, n) for f, m in cells))}"
            )
    return sizes


def with_dtype(reference: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    """The reference's observations with ``dtype`` as the compute dtype every step must see."""
    return {key: {**observed, "dtype": dtype} if "dtype" in observed else observed for key, observed in reference.items()}


def tolerance_for(backend: str, world_size: int) -> float:
    """How far ``backend``'s cells at ``world_size`` may be from the reference: bitwise on 1 rank
    (the reference is the same computation), else summation order (fp32) or rounding (bf16/fp16);
    rounding on every world size when the backend computes in another dtype than its reference."""
    lower, own_dtype = lower_precision(backend)
    if world_size == 1 and not own_dtype:
        return 0.0
    return LOWER_PRECISION_TOLERANCE if lower else FP32_TOLERANCE


def judge_cells(
    backend: str,
    cells: Sequence[Cell],
    ranks: List[Dict[str, Any]],
    reference: Dict[str, Any],
    world_size: int,
    lower: Optional[bool] = None,
    own_dtype: bool = False,
) -> List[Row]:
    """The rows of ``cells`` from every rank's observations (``ranks``) and the reference's
    (``lower``, ``own_dtype``: see :func:`lower_precision`; None: found here)."""
    instance = build_backend(backend)
    declared = instance.declared_unsupported_features
    if lower is None:
        tolerance = tolerance_for(backend, world_size)
        if lower_precision(backend)[1]:
            reference = with_dtype(reference, declared_dtype(backend) or "")
    else:
        tolerance = 0.0 if world_size == 1 and not own_dtype else LOWER_PRECISION_TOLERANCE if lower else FP32_TOLERANCE
    rows = []
    for feature, model in cells:
        key = cell_key(feature, model)
        observed = [rank.get(key, {"error": "not run"}) for rank in ranks]
        row = judge(
            FEATURES[feature], key, observed, reference.get(key, {}), tolerance, instance.resume_tolerance, declared.get(feature)
        )
        rows.append(_with_known_seam(row, feature, model, backend, world_size))
    return rows


def _with_known_seam(row: Row, feature: str, model: str, backend: str, ranks: int) -> Row:
    reason = known_seam(feature, model, backend, ranks)
    if reason is None or row.result == "REFUSED":
        return row
    if row.result == "FAIL":
        return Row(row.check, row.ranks, "KNOWN", f"{row.figure} [{reason}]", row.tolerance)
    return Row(row.check, row.ranks, "FIXED", f"{row.figure} [known seam passes now: remove it: {reason}]", row.tolerance)


_OLD_CHECKS = {"evaluation": ["evaluate"], "resume": ["resume_kill9", "resume_signal"], "best": ["evaluate_checkpoints"]}


def _renamed(names: Sequence[str]) -> List[str]:
    """Feature names for the kit's former check names (``evaluation``, ``resume``, ``best``)."""
    return [new for name in names for new in _OLD_CHECKS.get(name, [name])]


def _layout(backend: str, ranks: int) -> str:
    """The layout's words for the table's first line ("" for a backend no longer registered: a table
    may be printed after a test unregistered its plugin)."""
    try:
        return describe_layout(backend, ranks)
    except ValueError:
        return ""


def format_table(backend: str, rows: List[Row]) -> str:
    """The table as text: cell, ranks, result, figure, tolerance; then which cells failed."""
    header = ("cell", "ranks", "result", "figure", "tolerance")
    lines = [header] + [(row.check, str(row.ranks), row.result, row.figure[:160], row.tolerance) for row in rows]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    layouts = [f"{ranks} ranks: {_layout(backend, ranks)}" for ranks in sorted({row.ranks for row in rows}) if ranks > 1]
    meshes = [layout for layout in layouts if not layout.endswith(": ")]
    text = [f"conformance of backend {backend!r}" + (f" ({'; '.join(meshes)})" if meshes else "")]
    for index, line in enumerate(lines):
        text.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        if index == 0:
            text.append("  ".join("-" * width for width in widths))
    failed = [f"{row.check} ({row.ranks} rank{'s' if row.ranks > 1 else ''})" for row in rows if not row.ok]
    text.append(f"{len(rows) - len(failed)} of {len(rows)} passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(text)
