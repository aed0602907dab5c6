"""Run a function in 2 real gloo ranks (torch.multiprocessing), with torchrun's environment."""

import os
import socket
import time
import traceback
from typing import Any, Callable, Dict, List

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, kwargs: Dict[str, Any], results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch

    torch.set_num_threads(1)
    try:
        results[rank] = ("ok", fn(rank=rank, **kwargs))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise


TIMEOUT_SCALE = float(os.environ.get("FRAMEWORK_TEST_TIMEOUT_SCALE", "3"))
"""Every rank timeout is multiplied by this: a timeout measured on a quiet machine holds under load
(2 shared cores running other tests); raise it further on a slower machine."""


def run_ranks(fn: Callable, world_size: int = 2, timeout: float = 120, **kwargs: Any) -> List[Any]:
    """``fn(rank=r, **kwargs)`` in ``world_size`` processes; returns each rank's result.

    ``timeout`` (seconds, on a quiet machine) is scaled by :data:`TIMEOUT_SCALE`.

    ``fn`` must be importable (defined at module level in a test file). Raises if any rank fails.
    """
    context = mp.get_context("spawn")
    manager = context.Manager()
    results = manager.dict()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, kwargs, results)) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout * TIMEOUT_SCALE
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            raise TimeoutError(f"rank process {process.pid} did not finish within {timeout * TIMEOUT_SCALE:g}s")
    errors = [results[r][1] for r in range(world_size) if r in results and results[r][0] == "error"]
    if errors or any(p.exitcode != 0 for p in processes):
        raise RuntimeError("a rank failed:\n" + "\n".join(errors) + f"\nexit codes: {[p.exitcode for p in processes]}")
    return [results[r][1] for r in range(world_size)]
