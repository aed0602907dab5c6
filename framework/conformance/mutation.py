"""The kit's mutation score: run the cells that must kill each mutant (``framework.conformance.mutants``)
and report which cell killed it, with its figure; the mutant's correct counterpart (its control)
must pass the same cells.

    python -m framework.conformance --mutants [--all] [--only NAME,...]

Mutants of one world size share one run: the 1-rank ones run in this process, the 2-rank ones
(and their controls) on one set of spawned ranks, each cell in a process group of its own.
"""

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from backends import build_backend
from framework.conformance.checks import Cell, Context, run_cells
from framework.conformance.compare import Row
from framework.conformance.matrix import quick_cells, runs_at, targeted_cells
from framework.conformance.mutants import MUTANTS, Mutant
from framework.conformance.ranks import run_jobs
from framework.conformance.runner import (
    ReferenceCache,
    judge_cells,
    reference_backend,
    reference_observations,
    shapes_of,
)

MUTANTS_MODULE = "framework.conformance.mutants"


@dataclass
class Verdict:
    """One backend (a mutant, or a correct control) on its cells: killed (a cell failed) or not.

    Attributes:
        backend: the backend's name.
        fault: the mutant's fault (empty for a control).
        rows: its rows of the table.
    """

    backend: str
    fault: str
    rows: List[Row]

    @property
    def killed(self) -> bool:
        """A cell failed on a run that started (a known seam's KNOWN and a harness ERROR do not count)."""
        return any(row.result == "FAIL" for row in self.rows)

    @property
    def errors(self) -> List[Row]:
        """Rows whose run never started (the harness's error): no verdict, never a kill."""
        return [row for row in self.rows if row.result == "ERROR"]

    @property
    def killer(self) -> Optional[Row]:
        """The first failing row."""
        return next((row for row in self.rows if row.result == "FAIL"), None)


def control_of(mutant: str) -> str:
    """The correct backend a mutant was made from (``mutant-ddp-...`` -> ``ddp``; the scaled amp
    precision's correct counterpart is ``sp-scaled-amp``, registered with the mutants)."""
    declared = MUTANTS[mutant].control
    if declared:
        return declared
    stem = mutant.removeprefix("mutant-")
    for name in ("model-parallel", "fsdp-amp", "fsdp-bf16", "ddp-amp", "ddp-bf16", "sp-amp", "sp-bf16", "fsdp", "ddp", "sp"):
        if stem.startswith(name + "-"):
            return name
    raise ValueError(f"mutant {mutant!r}: no control; name it mutant-<backend>-<fault> or declare control=")


def cells_of(mutant: Mutant, every: bool) -> List[Tuple[Cell, int]]:
    """The cells (and world sizes) a mutant runs: the ones it declares, or (``every``) the quick
    set at the world sizes it declares, and the ones it declares (a targeted shape's cell may be
    outside the quick set)."""
    declared = [((feature, model), ranks) for feature, model, ranks in mutant.kills]
    if not every:
        return declared
    sizes = sorted({ranks for _, _, ranks in mutant.kills})
    chosen = shapes_of(mutant.name, quick_cells() + targeted_cells(control_of(mutant.name)))  # a pipeline row: its shape's
    quick = [(cell, ranks) for ranks in sizes for cell in chosen if runs_at(*cell, ranks) and cell[0] != "world_size_change"]
    return quick + [entry for entry in declared if entry not in quick]


def run_mutants(
    names: Optional[Sequence[str]] = None,
    every: bool = False,
    workdir: Optional[str] = None,
    timeout: float = 1800.0,
    reference_cache: Optional[ReferenceCache] = None,
    controls: bool = True,
    imports: Sequence[str] = (),
) -> Tuple[List[Verdict], List[Verdict]]:
    """Run every mutant (or those ``names``d) on the cells that must kill it, and (``controls``)
    each one's correct counterpart on the same cells; return (mutants' verdicts, controls' verdicts).

    ``imports``: modules (``--import``) that register mutants from outside the library; the
    spawned ranks import them too, so an outside mutant is built there as here."""
    chosen = list(names) if names else list(MUTANTS)
    unknown = [name for name in chosen if name not in MUTANTS]
    if unknown:
        raise ValueError(f"unknown mutant(s) {unknown}; registered: {', '.join(MUTANTS)}")
    workdir = workdir or tempfile.mkdtemp(prefix="conformance-mutants-")
    cache: ReferenceCache = reference_cache if reference_cache is not None else {}
    wanted: Dict[Tuple[str, int], List[Cell]] = {}  # (backend, ranks) -> cells
    for name in chosen:
        for cell, ranks in cells_of(MUTANTS[name], every):
            for backend in [name, control_of(name)] if controls else [name]:
                cells = wanted.setdefault((backend, ranks), [])
                if cell not in cells:
                    cells.append(cell)
    references = {}
    for (backend, ranks), cells in wanted.items():
        reference = reference_backend(backend)
        references[(backend, ranks)] = reference_observations(reference, cells, workdir, cache)
    observed: Dict[Tuple[str, int], List[Dict]] = {}
    jobs = []
    for (backend, ranks), cells in wanted.items():
        declared = build_backend(backend).declared_unsupported_features  # such a cell must be refused before step 1
        context = Context(backend, os.path.join(workdir, backend, f"ranks{ranks}"), shared=workdir, declared=declared)
        if ranks == 1:
            observed[(backend, ranks)] = [run_cells(context, cells)]
        else:
            jobs.append(((backend, ranks), context, cells))
    for size in sorted({ranks for (_, ranks), _, _ in jobs}):
        sized = [job for job in jobs if job[0][1] == size]
        results = run_jobs([(context, cells) for _, context, cells in sized], [MUTANTS_MODULE, *imports], size, timeout)
        for (key, _, _), result in zip(sized, results):
            observed[key] = result
    verdicts: Dict[str, Verdict] = {}
    for (backend, ranks), cells in wanted.items():
        rows = judge_cells(backend, cells, observed[(backend, ranks)], references[(backend, ranks)], ranks)
        fault = MUTANTS[backend].fault if backend in MUTANTS else ""
        verdicts.setdefault(backend, Verdict(backend, fault, [])).rows.extend(rows)
    mutants = [verdicts[name] for name in chosen]
    return mutants, [verdict for name, verdict in verdicts.items() if name not in MUTANTS]


_NUMBER = re.compile(r"max \|[^|]+\|(?: / max\(1, \|ref\|\))? = ([0-9.eE+-]+|inf|nan)")


def largest_figure(row: Row) -> float:
    """The largest ``max |... - ref| = X`` of a row's figure (inf where a row failed without one)."""
    values = [float(value) for value in _NUMBER.findall(row.figure)]
    return max(values) if values else float("inf")


def margins(mutants: List[Verdict], controls: List[Verdict]) -> List[str]:
    """Per tolerance: the largest distance of a correct control from the reference against the
    smallest distance of a killed mutant, over the cells judged with that tolerance."""
    spread: Dict[str, float] = {}
    error: Dict[str, Tuple[float, str]] = {}
    for verdict in controls:
        for row in verdict.rows:
            if row.result == "PASS":
                spread[row.tolerance] = max(spread.get(row.tolerance, 0.0), largest_figure(row) if "max |" in row.figure else 0.0)
    for verdict in mutants:
        killer = verdict.killer
        if killer is not None and "max |" in killer.figure:
            value = largest_figure(killer)
            if value < error.get(killer.tolerance, (float("inf"), ""))[0]:
                error[killer.tolerance] = (value, verdict.backend)
    lines = []
    for tolerance in sorted(set(spread) | set(error)):
        worst = spread.get(tolerance)
        smallest, who = error.get(tolerance, (None, ""))
        lines.append(
            f"tolerance {tolerance}: correct controls at most {'-' if worst is None else f'{worst:.2g}'}, "
            f"smallest mutant error {'-' if smallest is None else f'{smallest:.2g} ({who})'}"
        )
    return lines


def format_mutants(mutants: List[Verdict], controls: List[Verdict]) -> str:
    """The mutation score, a line per mutant (killed by which cell, with its figure), the controls
    that failed (a correct backend must pass) and the tolerance margins."""
    killed = [verdict for verdict in mutants if verdict.killed]
    errors = [verdict for verdict in mutants if verdict.errors]
    lines = [f"mutation score: {len(killed)} of {len(mutants)} killed ({100 * len(killed) // max(len(mutants), 1)}%)"]
    if errors:
        lines[0] += f"; {len(errors)} could not be run (harness errors: no verdict)"
    for verdict in mutants:
        killer = verdict.killer
        if verdict.errors:
            error = verdict.errors[0]
            lines.append(f"ERROR     {verdict.backend} in {error.check} ({error.ranks}): {error.figure[:160]}")
        elif killer is None:
            lines.append(f"SURVIVED  {verdict.backend}: {verdict.fault}")
        else:
            ranks = f"{killer.ranks} rank{'s' if killer.ranks > 1 else ''}"
            lines.append(f"killed    {verdict.backend} by {killer.check} ({ranks}): {killer.figure[:160]}")
    failing = [
        f"{verdict.backend}: {row.check} ({row.ranks}) {row.figure[:120]}"
        for verdict in controls
        for row in verdict.rows
        if not row.ok
    ]
    verdict_line = "every correct backend passes its mutants' cells" if not failing else "FAILED: " + "; ".join(failing)
    lines.append("controls: " + verdict_line)
    lines += margins(mutants, controls)
    return "\n".join(lines)


def markdown_mutants(mutants: List[Verdict], controls: List[Verdict]) -> str:
    """The mutation score and one table row per mutant (its kind, fault, killing cell and figure), for the docs."""
    killed = sum(verdict.killed for verdict in mutants)
    lines = [
        f"Mutation score: **{killed} of {len(mutants)} killed** ({100 * killed // max(len(mutants), 1)}%); every "
        "control (the correct backend each mutant was made from) passes the same cells.",
        "",
        "| mutant | promise | fault | killed by (ranks) | figure |",
        "| --- | --- | --- | --- | --- |",
    ]
    for verdict in mutants:
        killer = verdict.killer
        cell = f"{killer.check} ({killer.ranks})" if killer else "**survived**"
        figure = (killer.figure if killer else "").replace("|", "\\|")[:110]
        fault = verdict.fault.replace("|", "\\|")
        lines.append(f"| `{verdict.backend}` | {MUTANTS[verdict.backend].kind} | {fault} | {cell} | {figure} |")
    return "\n".join([*lines, "", *(f"- {line}" for line in margins(mutants, controls))])
