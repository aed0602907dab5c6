"""What the framework adds to one optimizer step, counted without a timer.

Runs the hand-written loop and the framework (extras off, and at its defaults) on the tiny MLP
of ``overhead.py`` for a short and a long run in this process and counts, per optimizer step
(long minus short, over the steps between them, so set-up and tear-down cancel out):

- aten ops, by name (a ``TorchDispatchMode``), and of those the fresh tensors (outputs whose
  storage is none of the inputs') and host-device syncs (``_local_scalar_dense``: ``.item()``,
  ``float()``, ``bool()`` of a tensor; ``_to_copy`` to the CPU from another device);
- Python function calls (``sys.setprofile``: Python and C functions);
- garbage collections by generation and the seconds they took (``gc.callbacks``), and the
  net count of container objects the collector tracks (its generation-0 counter).

Counts are the same on every call (they do not jitter as timers do); the test suite holds them
to a budget (``tests/test_step_cost.py``). ``--ddp`` counts rank 0 of a 2-rank gloo group, raw
DDP loop against the framework's ``ddp``. ``--time ROUNDS`` also times the steady per-step cost
in fresh processes, alternating, through ``fresh_process.py``'s children. ``--instructions``
instead counts the CPU instructions per step of those children under valgrind (cachegrind):
a count that does not jitter, of everything a step costs the CPU (Python, libtorch, malloc, the GIL).

    python benchmarks/step_cost.py [--samples 8192] [--epochs 1 3] [--ddp] [--time 10] [--instructions]
"""

import argparse
import collections
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from ddp_overhead import make_data  # noqa: E402

from overhead import BATCH, BenchmarkModule, raw_loop  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402

SYNC_OPS = ("_local_scalar_dense",)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name and the fresh tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.fresh_tensors = 0
        self.device_to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        result = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if _has_storage(t)}
        for output in _tensors(result):
            if _has_storage(output) and output.untyped_storage().data_ptr() not in inputs:
                self.fresh_tensors += 1
        if name == "_to_copy" and kwargs.get("device") == torch.device("cpu"):
            source = next(iter(_tensors(args)), None)
            if source is not None and source.device.type != "cpu":
                self.device_to_host += 1
        return result


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _has_storage(tensor: torch.Tensor) -> bool:
    try:
        return tensor.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):
        return False


@dataclasses.dataclass
class Counts:
    """Everything counted over one run: aten ops and Python calls by name, fresh tensors,
    host-device syncs, collections by generation, the collector's seconds, tracked objects."""

    ops: collections.Counter
    calls: collections.Counter
    fresh: int
    syncs: int
    gcs: List[int]
    gc_seconds: float
    tracked: int

    def minus(self, other: "Counts", steps: int) -> Dict[str, Any]:
        """Per step of the difference ``self - other`` over ``steps`` steps."""
        return {
            "aten ops": (sum(self.ops.values()) - sum(other.ops.values())) / steps,
            "ops by name": _per_step(self.ops, other.ops, steps),
            "fresh tensors": (self.fresh - other.fresh) / steps,
            "host-device syncs": (self.syncs - other.syncs) / steps,
            "python calls": (sum(self.calls.values()) - sum(other.calls.values())) / steps,
            "calls by name": _per_step(self.calls, other.calls, steps),
            "collections gen 0/1/2": [(a - b) / steps for a, b in zip(self.gcs, other.gcs)],
            "collector seconds": (self.gc_seconds - other.gc_seconds) / steps,
            "tracked objects (net)": (self.tracked - other.tracked) / steps,
        }


def _per_step(long: collections.Counter, short: collections.Counter, steps: int) -> Dict[str, float]:
    return {name: (long[name] - short[name]) / steps for name in set(long) | set(short) if long[name] != short[name]}


def count(train: Callable[[], None]) -> Counts:
    """Run ``train`` twice: once under the op counter, once under the call profiler and the
    collector's callbacks (the op counter's own Python calls would be counted otherwise)."""
    counter = OpCounter()
    with counter:
        train()
    calls: collections.Counter = collections.Counter()
    collections_by_generation, gc_seconds, started = [0, 0, 0], [0.0], [0.0]

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            code = frame.f_code
            calls[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            calls[getattr(arg, "__qualname__", str(arg))] += 1

    def on_gc(phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections_by_generation[info["generation"]] += 1
            gc_seconds[0] += time.perf_counter() - started[0]

    gc.collect()
    threshold = gc.get_threshold()[0]
    tracked_before = gc.get_count()[0]
    gc.callbacks.append(on_gc)
    sys.setprofile(profile)
    try:
        train()
    finally:
        sys.setprofile(None)
        gc.callbacks.remove(on_gc)
    tracked = collections_by_generation[0] * threshold + gc.get_count()[0] - tracked_before
    syncs = sum(counter.ops[name] for name in SYNC_OPS) + counter.device_to_host
    return Counts(counter.ops, calls, counter.fresh_tensors, syncs, collections_by_generation, gc_seconds[0], tracked)


def framework_train(data: TensorDataset, epochs: int, output_dir: str, quiet: bool, backend: str = "sp") -> None:
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    args = TrainerArguments(
        epochs=epochs,
        train_batch_size=BATCH * world_size,  # 32 per rank, as the raw loops
        backend=backend,
        seed=0,
        output_dir=tempfile.mkdtemp(dir=output_dir),
        use_gpu=False,
        disable_tqdm=True,  # the bar refreshes on a timer: counts would depend on the clock
        plot_metrics=False,  # drawn once at the run's end: a fixed cost, and matplotlib's caches warm up run by run
        checkpointer_args={"period": 0, "save_at_end": False},
    )
    if quiet:
        args.log_every_n_steps, args.log_level = 10**9, "WARNING"
    Trainer(BenchmarkModule(data), args).train()


def per_step(runner: Callable[[int], None], epochs: Sequence[int], steps_per_epoch: int) -> Counts:
    """Counts of a short and a long run; returns them for :meth:`Counts.minus`."""
    short, long = (count(lambda e=e: runner(e)) for e in epochs)  # type: ignore[misc]
    return long.minus(short, (epochs[1] - epochs[0]) * steps_per_epoch)  # type: ignore[return-value]


def measure(samples: int, epochs: Sequence[int], backend: str = "sp") -> Dict[str, Dict[str, Any]]:
    """Per-step counts of the raw loop and of the framework (quiet and defaults), and the
    framework's excess over the raw loop."""
    torch.set_num_threads(1)
    data = make_data(samples)
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    steps_per_epoch = samples // (BATCH * world_size)
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as output_dir:
        raw_loop(data, 1)  # first-step imports (AdamW's torch._dynamo) out of the counts
        framework_train(data, 1, output_dir, True, backend)
        runners: Dict[str, Callable[[int], None]] = {
            "raw": lambda e: _raw(data, e, backend),
            "quiet": lambda e: framework_train(data, e, output_dir, True, backend),
            "defaults": lambda e: framework_train(data, e, output_dir, False, backend),
        }
        for name, runner in runners.items():
            results[name] = per_step(runner, epochs, steps_per_epoch)  # type: ignore[assignment]
    for name in ("quiet", "defaults"):
        results[f"{name} - raw"] = excess(results[name], results["raw"])
    return results


def _raw(data: TensorDataset, epochs: int, backend: str) -> None:
    if backend == "sp":
        raw_loop(data, epochs)  # overhead.py's hand-written loop (its two clock reads cancel out)
        return
    from ddp_overhead import raw_ddp_loop

    raw_ddp_loop(data, epochs, BATCH)


BY_NAME = ("ops by name", "calls by name")


def excess(framework: Dict[str, Any], raw: Dict[str, Any]) -> Dict[str, Any]:
    """``framework - raw``, field by field (by name: only what differs, largest first)."""
    result: Dict[str, Any] = {}
    for key, value in framework.items():
        if key in BY_NAME:
            names = set(value) | set(raw[key])
            diff = {n: value.get(n, 0.0) - raw[key].get(n, 0.0) for n in names}
            result[key] = dict(sorted(((n, round(v, 3)) for n, v in diff.items() if abs(v) > 1e-9), key=lambda kv: -abs(kv[1])))
        elif isinstance(value, list):
            result[key] = [a - b for a, b in zip(value, raw[key])]
        else:
            result[key] = value - raw[key]
    return result


def print_table(results: Dict[str, Dict[str, Any]], top: int = 25) -> None:
    keys = [k for k in results["raw"] if k not in BY_NAME]
    print(f"{'per optimizer step':24s}" + "".join(f"{name:>18s}" for name in results))
    for key in keys:
        cells = []
        for row in results.values():
            value = row[key]
            cells.append("/".join(f"{v:.3f}" for v in value) if isinstance(value, list) else _fmt(value))
        print(f"{key:24s}" + "".join(f"{cell:>18s}" for cell in cells))
    for name in ("quiet - raw", "defaults - raw"):
        for key in BY_NAME:
            items = list(results[name][key].items())
            shown = ", ".join(f"{n} {v:+g}" for n, v in items[:top]) or "none"
            print(f"{key} ({name}, {len(items)} differ): {shown}")


def _fmt(value: float) -> str:
    return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.3f}"


def ddp_rank(rank: int, world_size: int, port: int, samples: int, epochs: Sequence[int], out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = measure(samples, epochs, backend="ddp")
        if rank == 0:
            torch.save(results, out)
    finally:
        torch.distributed.destroy_process_group()


def measure_ddp(samples: int, epochs: Sequence[int]) -> Dict[str, Dict[str, Any]]:
    """Rank 0's counts in a 2-rank gloo group (the raw DDP loop against the framework's ``ddp``)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "counts.pt")
        mp.spawn(ddp_rank, args=(2, port, samples, list(epochs), out), nprocs=2)
        return torch.load(out, weights_only=False)


def time_fresh(rounds: int, epochs: int) -> None:
    """Steady seconds per step (second epoch to the end) in fresh processes, alternating."""
    from fresh_process import json_objects, run_process_output

    steady: Dict[str, List[float]] = {"raw": [], "quiet": [], "defaults": []}
    for _ in range(rounds):
        for name in steady:
            _, output = run_process_output([os.path.join(HERE, "fresh_process.py"), "--child", name, "--epochs", str(epochs)])
            steady[name].append(json_objects(output)[-1]["steady_seconds"])
    raw = steady["raw"]
    for name in ("quiet", "defaults"):
        median = statistics.median(steady[name]) / statistics.median(raw)
        paired = statistics.median(f / r for f, r in zip(steady[name], raw))
        print(f"steady per-step time, {name} / raw: {median:.3f} (medians), {paired:.3f} (paired), {rounds} rounds")


def count_instructions(epochs: Sequence[int], parallel: int = 2) -> Dict[str, float]:
    """CPU instructions per step of the raw loop and the framework (quiet, defaults without the
    end-of-run plot), each run a fresh ``fresh_process.py`` child under valgrind's cachegrind
    (``--cache-sim=no``: instructions only), long run minus short run, with one OpenMP/BLAS
    thread (an idle BLAS worker spinning under valgrind added up to 80,000 instructions a step)
    and a fixed string-hash seed (a random one moves dict probing by about 10,000 a step).
    Timers move by 1-10% between calls; each run takes about a minute."""
    import re
    import shutil
    import subprocess

    from fresh_process import user_environment

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    environment = dict(user_environment(), FRAMEWORK_PLOT_METRICS="0", PYTHONHASHSEED="0")
    runs = [(name, epochs_) for name in ("raw", "quiet", "defaults") for epochs_ in epochs]
    totals: Dict[Any, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for start in range(0, len(runs), parallel):
            started = []
            for name, epochs_ in runs[start : start + parallel]:
                command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={folder}/{name}.{epochs_}"]
                command += [sys.executable, os.path.join(HERE, "fresh_process.py"), "--child", name, "--epochs", str(epochs_)]
                started.append(
                    (
                        (name, epochs_),
                        subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                    )
                )
            for key, process in started:
                _, stderr = process.communicate()
                found = re.search(r"I\s+refs:\s+([\d,]+)", stderr)
                if process.returncode != 0 or found is None:
                    raise SystemExit(f"{key}: valgrind failed ({process.returncode}):\n{stderr[-2000:]}")
                totals[key] = int(found.group(1).replace(",", ""))
    steps = (epochs[1] - epochs[0]) * 8192 // BATCH
    per_step = {name: (totals[(name, epochs[1])] - totals[(name, epochs[0])]) / steps for name in ("raw", "quiet", "defaults")}
    for name in ("raw", "quiet", "defaults"):
        extra = per_step[name] - per_step["raw"]
        ratio = per_step[name] / per_step["raw"]
        print(f"instructions per step, {name:<8} {per_step[name]:>11,.0f}  ({extra:+,.0f}, {ratio:.4f}x raw)")
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8192, help="samples per epoch (batch 32 per rank)")
    parser.add_argument("--epochs", type=int, nargs=2, default=[1, 3], help="the short and the long run")
    parser.add_argument("--ddp", action="store_true", help="2-rank gloo: rank 0's counts")
    parser.add_argument("--time", type=int, default=0, metavar="ROUNDS", help="also time fresh processes, alternating")
    parser.add_argument("--time-epochs", type=int, default=4, help="epochs of each timed fresh process")
    parser.add_argument("--instructions", action="store_true", help="only CPU instructions per step, under valgrind (sp)")
    options = parser.parse_args()
    if options.instructions:
        count_instructions(options.epochs)
        return
    results = measure_ddp(options.samples, options.epochs) if options.ddp else measure(options.samples, options.epochs)
    print_table(results)
    if options.time:
        time_fresh(options.time, options.time_epochs)


if __name__ == "__main__":
    main()
