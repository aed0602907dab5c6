"""Run the checks: the ``sp`` reference in this process, the backend on 1 rank here and on 2
ranks in one process group (gloo on CPU, NCCL where there is a GPU per rank)."""

import importlib
import importlib.util
import os
import sys
import tempfile
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch

from backends import build_backend
from framework.conformance.checks import CHECKS, Context, run_checks
from framework.conformance.compare import FEATURES, Row, judge

FP32_TOLERANCE = 1e-5
"""Largest parameter (or metric) difference from ``sp`` allowed in fp32: summation order only."""
LOWER_PRECISION_TOLERANCE = 5e-2
"""The same against ``sp-amp`` when the backend computes in bf16/fp16: rounding differs per layout."""


def import_plugin(name: str) -> None:
    """Import ``name``: a module name on ``sys.path`` or a ``.py`` file (registers its backends)."""
    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(name)
        module_name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--import {name}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(name)


def _rank_main(rank: int, world_size: int, port: int, backend: str, workdir: str, names: List[str], imports: List[str]) -> None:
    """One rank of the 2-rank run: join the process group once, run every check, save what it saw."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    for name in imports:
        import_plugin(name)
    use_gpu = torch.cuda.device_count() >= world_size
    if use_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world_size)
    try:
        context = Context(backend, workdir, rank, world_size, use_gpu)
        observed = run_checks(context, names)
    except BaseException:
        observed = {"error": traceback.format_exc()}
    torch.save(observed, os.path.join(workdir, f"observed-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    backend: str, workdir: str, names: List[str], imports: List[str], world_size: int, timeout: float
) -> List[Dict[str, Any]]:
    """The checks on ``world_size`` spawned ranks; each rank's observations (an error entry when it died or hung)."""
    context = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, backend, workdir, names, imports))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    hung = [process for process in processes if process.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    results = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"observed-rank{rank}.pt")
        if os.path.exists(path):
            results.append(torch.load(path, weights_only=False))  # written by this run's own ranks
        else:
            why = f"hung for more than {timeout:g} s" if hung else f"exited with status {processes[rank].exitcode}"
            results.append({name: {"error": f"rank {rank} {why}"} for name in names})
    for observed in results:
        if "error" in observed and isinstance(observed["error"], str):
            message = observed.pop("error").strip().splitlines()[-1]
            observed.update({name: {"error": message} for name in names})
    return results


_ONE_CPU_PROCESS = SimpleNamespace(use_gpu=False, cluster="local")
"""Backend options for looking at a backend in the kit's own process: CPU, no launcher."""


def compute_dtype(backend: str) -> Optional[torch.dtype]:
    """What ``backend``'s precision computes in on CPU (None: fp32)."""
    instance = build_backend(backend, _ONE_CPU_PROCESS)
    instance.setup()
    try:
        return instance.compute_dtype
    finally:
        instance.teardown()


def conformance(
    backend: str,
    imports: Sequence[str] = (),
    world_sizes: Sequence[int] = (1, 2),
    names: Optional[Sequence[str]] = None,
    workdir: Optional[str] = None,
    timeout: float = 600.0,
) -> List[Row]:
    """Run the checks ``names`` (default: all) against ``backend`` and return the table's rows."""
    for name in imports:
        import_plugin(name)
    names = list(names or CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; allowed: {', '.join(CHECKS)}")
    instance = build_backend(backend)
    declared = instance.declared_unsupported_features
    multi_process = instance.multi_process
    lower_precision = compute_dtype(backend) is not None
    reference_name = "sp-amp" if lower_precision else "sp"
    parameter_tolerance = LOWER_PRECISION_TOLERANCE if lower_precision else FP32_TOLERANCE
    resume_tolerance = instance.resume_tolerance
    workdir = workdir or tempfile.mkdtemp(prefix="conformance-")
    runnable = [name for name in names if name not in declared]
    reference = run_checks(Context(reference_name, os.path.join(workdir, "reference")), runnable)
    features = [feature for feature in FEATURES if feature.check in names]
    rows: List[Row] = []
    for world_size in world_sizes:
        if world_size > 1 and not multi_process:
            continue  # a single-process strategy refuses multi-process launches
        if world_size == 1:
            ranks = (
                [reference]
                if backend == reference_name
                else [run_checks(Context(backend, os.path.join(workdir, "one")), runnable)]
            )
        else:
            directory = os.path.join(workdir, f"ranks{world_size}")
            os.makedirs(directory, exist_ok=True)
            ranks = run_ranks(backend, directory, runnable, list(imports), world_size, timeout)
        rows += [judge(feature, ranks, reference, parameter_tolerance, resume_tolerance, declared) for feature in features]
    return rows


def format_table(backend: str, rows: List[Row]) -> str:
    """The table as text: check, ranks, result, figure, tolerance."""
    header = ("check", "ranks", "result", "figure", "tolerance")
    lines = [header] + [(row.check, str(row.ranks), row.result, row.figure, row.tolerance) for row in rows]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = [f"conformance of backend {backend!r}"]
    for index, line in enumerate(lines):
        text.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        if index == 0:
            text.append("  ".join("-" * width for width in widths))
    failed = [row for row in rows if not row.ok]
    text.append(
        f"{len(rows) - len(failed)} of {len(rows)} passed" + (f"; FAILED: {', '.join(r.check for r in failed)}" if failed else "")
    )
    return "\n".join(text)
