"""The kit's ranks: cells run on spawned processes (gloo on CPU, NCCL where there is a GPU per
rank), each cell in a process group of its own, so that a cell whose collective fails, hangs
or kills a rank is that cell's FAIL, and the next cell starts afresh.

A rank that dies (a gloo abort, a segfault) ends the launch: the cell it was in is recorded as
failed on every rank, and the ranks are launched again from the next cell.
"""

import contextlib
import datetime
import importlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from framework.conformance.checks import Cell, Context, cell_key, run_cells

CELL_COLLECTIVE_TIMEOUT = 120.0
"""Seconds a collective of a cell may wait for a peer on the kit's ranks (then the cell fails)."""
DEATH_GRACE = 5.0
"""Seconds the other ranks get to finish once a rank died, before they are stopped."""

Job = Tuple[Context, List[Cell]]
"""One backend's cells on the ranks: its context (backend, directory) and the cells."""


def import_plugin(name: str) -> None:
    """Import ``name``: a module or package name on ``sys.path``, a ``.py`` file, or a package
    directory (registers its backends).

    Raises:
        ValueError: ``name`` is a directory without ``__init__.py``, or a file that cannot be imported.
    """
    path = os.path.abspath(name)
    if os.path.isdir(path):  # a package directory: imported by its name from its parent directory
        if not os.path.isfile(os.path.join(path, "__init__.py")):
            raise ValueError(f"--import {name}: a directory must be a package (hold __init__.py) to be imported")
        parent = os.path.dirname(path)
        if parent not in sys.path:
            sys.path.insert(0, parent)
        importlib.import_module(os.path.basename(path))
    elif name.endswith(".py") or os.sep in name:
        module_name = os.path.splitext(os.path.basename(path))[0]
        imported = sys.modules.get(module_name)
        if imported is not None and os.path.abspath(getattr(imported, "__file__", None) or "") == path:
            return  # imported already (the command line imports before the kit does): run its registrations once
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--import {name}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(name)


def _import_all(imports: Sequence[str]) -> Optional[str]:
    """Import every ``--import`` in a spawned rank; what went wrong, or None."""
    for name in imports:
        try:
            import_plugin(name)
        except Exception as error:  # reported as the harness's error, naming the import
            return f"--import {name} failed on a spawned rank: {type(error).__name__}: {error}"
    return None


def _observed_path(context: Context, rank: int) -> str:
    return os.path.join(context.workdir, f"observed-rank{rank}.pt")


def _load(path: str) -> Dict[str, Any]:
    return torch.load(path, weights_only=False) if os.path.exists(path) else {}  # written by this run's own ranks


def _rank_main(
    rank: int, world_size: int, port: int, jobs: List[Job], imports: List[str], start: Tuple[int, int], progress: str
) -> None:
    """One rank: every job's cells from ``start`` (job, cell) on, each cell in a process group of
    its own (on one store); what each job saw is saved after every cell, and ``progress`` names
    the cell being run (so a rank that dies is known to have died in it)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    use_gpu = torch.cuda.device_count() >= world_size
    if use_gpu:
        torch.cuda.set_device(rank)
    wait = datetime.timedelta(seconds=CELL_COLLECTIVE_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=wait)
    counter = iter(range(1 << 30))

    @contextlib.contextmanager
    def own_group() -> Iterator[None]:
        """A fresh process group for one cell; destroyed after it, at once when the cell failed
        (a peer blocked in a collective then fails too, instead of waiting for its timeout)."""
        prefix = f"cell-{next(counter)}"
        backend = "nccl" if use_gpu else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, timeout=wait)
        try:
            yield
        finally:
            dist.destroy_process_group()
            time.sleep(0.05)  # gloo's threads release the GIL (see DDP.teardown)

    try:
        failed_import = _import_all(imports)
        if failed_import is not None:  # no cell can start: each is the harness's error, on every rank
            for context, cells in jobs:
                torch.save({cell_key(*cell): {"harness": failed_import} for cell in cells}, _observed_path(context, rank))
            return
        for job_index, (context, cells) in enumerate(jobs):
            if job_index < start[0]:
                continue
            here = Context(**{**context.__dict__, "rank": rank, "world_size": world_size, "use_gpu": use_gpu})
            path = _observed_path(context, rank)
            observed = _load(path) if job_index == start[0] else {}
            for cell_index, cell in enumerate(cells):
                if job_index == start[0] and cell_index < start[1]:
                    continue
                with open(progress, "w", encoding="utf-8") as handle:
                    handle.write(f"{job_index} {cell_index}")
                try:
                    observed.update(run_cells(here, [cell], around=own_group))
                except BaseException:
                    observed[cell_key(*cell)] = {"error": traceback.format_exc().strip().splitlines()[-1]}
                torch.save(observed, path)
            torch.save(observed, path)
    finally:
        time.sleep(0.2)  # let gloo's threads release the GIL before the interpreter exits (see DDP.teardown)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(context: Context, cells: List[Cell], imports: List[str], world_size: int, timeout: float) -> List[Dict[str, Any]]:
    """The cells on ``world_size`` spawned ranks; each rank's observations (an error entry when it died or hung)."""
    return run_jobs([(context, cells)], imports, world_size, timeout)[0]


def _died(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with status {code}"


def _launch(jobs: Sequence[Job], imports: Sequence[str], world_size: int, start: Tuple[int, int], deadline: float) -> Any:
    """One launch of the ranks from ``start``; (exit codes, whether it hung, each rank's last (job, cell))."""
    spawn = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    directory = tempfile.mkdtemp(prefix="kit-progress-")
    progress = [os.path.join(directory, f"rank{rank}") for rank in range(world_size)]
    processes = [
        spawn.Process(target=_rank_main, args=(rank, world_size, port, list(jobs), list(imports), start, progress[rank]))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    first_death: Optional[float] = None
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        if first_death is None and any(process.exitcode not in (None, 0) for process in processes):
            first_death = time.monotonic()
        if first_death is not None and time.monotonic() - first_death > DEATH_GRACE:
            break
        time.sleep(0.2)
    hung = time.monotonic() >= deadline and any(process.is_alive() for process in processes)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    where: List[Optional[Tuple[int, int]]] = []
    for path in progress:
        with contextlib.suppress(OSError, ValueError):
            with open(path, encoding="utf-8") as handle:
                job, cell = handle.read().split()
            where.append((int(job), int(cell)))
            continue
        where.append(None)
    shutil.rmtree(directory, ignore_errors=True)
    return codes, hung, where


def run_jobs(jobs: Sequence[Job], imports: Sequence[str], world_size: int, timeout: float) -> List[List[Dict[str, Any]]]:
    """Several backends' cells on one set of ``world_size`` spawned ranks: per job, each rank's
    observations. A rank that dies fails the cell it was in (on every rank) and the ranks are
    launched again from the next cell; past ``timeout`` seconds every cell not yet run fails."""
    for context, _ in jobs:
        os.makedirs(context.workdir, exist_ok=True)
        for rank in range(world_size):
            with contextlib.suppress(FileNotFoundError):
                os.remove(_observed_path(context, rank))
    deadline = time.monotonic() + timeout
    start = (0, 0)
    failure: Dict[Tuple[int, int], List[str]] = {}  # (job, cell) -> each rank's error there
    unfinished = ""
    while start[0] < len(jobs):
        codes, hung, where = _launch(jobs, imports, world_size, start, deadline)
        if all(code == 0 for code in codes) and not hung:
            break
        dead = [rank for rank, code in enumerate(codes) if code not in (None, 0) and code != -signal.SIGKILL]
        if hung or not dead or where[dead[0]] is None:
            unfinished = f"hung for more than {timeout:g} s" if hung else f"rank {dead[0] if dead else 0} {_died(codes[0])}"
            break
        job, cell = where[dead[0]]
        failure[(job, cell)] = [
            f"rank {rank} {_died(codes[rank])} in this cell" if rank in dead else f"rank {rank} stopped: rank {dead[0]} died"
            for rank in range(world_size)
        ]
        start = (job, cell + 1) if cell + 1 < len(jobs[job][1]) else (job + 1, 0)
    every = []
    for job_index, (context, cells) in enumerate(jobs):
        results = []
        for rank in range(world_size):
            observed = _load(_observed_path(context, rank))
            for cell_index, cell in enumerate(cells):
                key = cell_key(*cell)
                if (job_index, cell_index) in failure:
                    observed[key] = {"error": failure[(job_index, cell_index)][rank]}
                elif key not in observed or not isinstance(observed[key], dict):
                    observed[key] = {"error": unfinished or f"rank {rank}: not run"}
            results.append(observed)
        every.append(results)
    return every
