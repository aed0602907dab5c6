"""``python -m framework.conformance BACKEND [--import MODULE] [--all]``: print the table of
cells (``--mutants``: the mutation score of the mutant library instead); exit 0 only when no
cell fails and every run started (a cell the backend declares unsupported must be refused
before step 1; a known seam is reported, not failed); exit 2 when the request is refused
(``--ranks`` at which no selected cell runs, a single-process backend on several ranks)."""

import argparse
import sys
from typing import List, Optional

from framework.conformance.matrix import Cell, all_cells, quick_cells, sized_cells, targeted_cells
from framework.conformance.registry import FEATURES, MODELS
from framework.conformance.runner import _renamed, conformance, declared_shapes, format_table, import_plugin, shapes_of


def _names(text: Optional[str]) -> Optional[List[str]]:
    return [name.strip() for name in text.split(",") if name.strip()] if text else None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.conformance", description=__doc__)
    parser.add_argument(
        "backend", nargs="?", default=None, help="a registered backend name (built-in, entry point, or registered by --import)"
    )
    parser.add_argument(
        "--mutants",
        action="store_true",
        help="run the mutant library (framework.conformance.mutants) instead: each mutant on the cells that must kill "
        "it (with --all: the quick set), its correct control on the same cells; print the mutation score",
    )
    parser.add_argument("--only", default=None, help="with --mutants: comma-separated mutant names (default: all)")
    parser.add_argument("--markdown", action="store_true", help="with --mutants: print the docs' Markdown table instead")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a module name or a .py file) first, so the backend it registers can be named; repeatable",
    )
    parser.add_argument("--all", action="store_true", help="every feature with every model (default: the quick subset)")
    parser.add_argument("--features", default=None, help=f"comma-separated subset of: {', '.join(FEATURES)}")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--checks", default=None, help="deprecated: --features (older names are translated)")
    parser.add_argument(
        "--ranks",
        default=None,
        help="world sizes to run, e.g. 1,2 or 2 or 4 (default: 1,2 for a multi-process backend, 1 otherwise; 4: the "
        "slow tier, HSDP 2x2 under fsdp, dp 2 x tp 2 under model-parallel); only cells that run at a size named are "
        "run (world_size_change also runs its 1-rank half); a size no selected cell runs at is refused",
    )
    parser.add_argument("--workdir", default=None, help="where runs write (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the multi-rank run may take")
    options = parser.parse_args(argv)
    if options.mutants:
        return _mutants(options)
    if options.backend is None:
        parser.error("name a backend, or --mutants")
    try:
        for name in options.imports:  # first: the cells below read what a plugin declares (conformance_shapes)
            import_plugin(name)
    except ValueError as error:
        print(f"python -m framework.conformance: error: {error}", file=sys.stderr, flush=True)
        return 2
    features = _names(options.features) or (_renamed(_names(options.checks) or []) or None)
    models = _names(options.models)
    if (features or options.all) and not models:  # a backend that trains only some shapes (a pipeline row) gets those
        models = declared_shapes(options.backend)
    if options.all:
        cells: Optional[List[Cell]] = all_cells(features, models)
    else:  # the default: the quick subset and (conformance's own default) the cells the shapes target on the backend
        cells = quick_cells(features, models) if features or models else None
    try:
        sizes = [int(size) for size in options.ranks.split(",")] if options.ranks else None
    except ValueError:
        parser.error(f"--ranks {options.ranks}: allowed: comma-separated integers >= 1, e.g. 1,2 or 4")
    if sizes:  # exactly the sizes asked: a cell that runs at none of them is not run at another size instead
        chosen = cells if cells is not None else shapes_of(options.backend, quick_cells() + targeted_cells(options.backend))
        cells = sized_cells(chosen, sizes) or chosen  # none left: conformance refuses, naming the sizes the cells run at
    try:
        rows = conformance(
            options.backend,
            imports=options.imports,
            world_sizes=sizes,
            cells=cells,
            workdir=options.workdir,
            timeout=options.timeout,
        )
    except ValueError as error:  # a request the kit cannot run as asked: refused, nothing reported as run
        print(f"python -m framework.conformance: error: {error}", file=sys.stderr, flush=True)
        return 2
    print(format_table(options.backend, rows), flush=True)
    return 0 if rows and all(row.ok for row in rows) else 1


def _mutants(options: argparse.Namespace) -> int:
    from framework.conformance.mutation import format_mutants, markdown_mutants, run_mutants

    for name in options.imports:
        import_plugin(name)
    mutants, controls = run_mutants(
        _names(options.only), every=options.all, workdir=options.workdir, timeout=options.timeout, imports=options.imports
    )
    print((markdown_mutants if options.markdown else format_mutants)(mutants, controls), flush=True)
    passed = all(verdict.killed and not verdict.errors for verdict in mutants)
    passed = passed and all(row.ok for verdict in controls for row in verdict.rows)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
