"""The whole run as a user pays for it: each run a fresh process, alternating with the raw loop.

Every run is a new ``python`` process (``--child NAME --epochs E``) that imports what it
needs, builds its data and model, steps one throwaway AdamW (the modules a first optimizer
imports, ``torch._dynamo``: about 0.7 s that every runner pays alike, loaded before any timer)
and trains the tiny MLP of ``overhead.py`` (32-64-64-10, batch 32, AdamW, 8192 in-memory
samples: 256 steps per epoch, one torch thread). The parent times each process from start to
exit; the child reports the time of its training call (``train()`` for the framework, the loop
for the raw code). Runs alternate within a round: raw, framework with extras off (no progress
bar, no step logging, no end-of-run plot), framework at its defaults (the plot included where
matplotlib is installed), then the peers that are installed (``pip install -e ".[bench]"``:
Lightning Fabric, Lightning, Accelerate).

Over 1, 2 and 4 epochs it fits, per runner, the seconds per step (the slope: what grows with
the run) and the fixed cost (the intercept: imports, set-up, first-step warm-up), and prints
each as a ratio to the raw loop's. The slope moves by +-15% between calls (each point carries a
fresh process's start-up noise), so it also reports the steady seconds per step inside each
process of the longest run: from its second epoch's start to the end of its last epoch (the
framework's ``on_end_train`` of the module, which runs before the callbacks draw or save), as a
ratio of medians and as the median of per-round ratios.
It also times ``import torch`` against ``import framework`` in fresh processes.

    python benchmarks/fresh_process.py [--repeats 5] [--epochs 1 2 4] [--runners raw quiet defaults fabric]

``--runners ... defaults-no-plot`` adds the defaults with ``FRAMEWORK_PLOT_METRICS=0`` (not run unless
named): what the background ``metrics.png`` drawing still costs ``train()`` and the whole process.

Targets (issue 34, "the step at the raw loop's cost"): steady per step at most 1.03x the raw
loop with extras off and 1.05x at the defaults; the 1024-step ``train()`` at most 1.05x; the
per-step cost below Fabric's; ``import framework`` within 0.25 s of ``import torch``. The
figures and what is left of the gap: docs/benchmarks.md.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = {"fabric": "lightning", "lightning": "lightning", "accelerate": "accelerate"}
RUNNERS = ("raw", "quiet", "defaults", *PEERS)
NO_PLOT = "defaults-no-plot"  # the defaults with FRAMEWORK_PLOT_METRICS=0: the plot's share (not run unless named)


# -- the children: one training run each, in a fresh process ----------------------------------
def _child(name: str, epochs: int, output_dir: str, hidden: int = 64) -> Tuple[float, float]:
    """Train in this process with runner ``name`` (MLP width ``hidden``); return the training
    call's seconds and the seconds from the second epoch's start to the end (0 for one epoch)."""
    import torch

    torch.set_num_threads(1)
    sys.path[:0] = [HERE, ROOT]
    from overhead import make_data

    data = make_data()
    _import_first_step_modules()
    if name == "raw":
        return _raw_loop(data, epochs, hidden)
    if name == NO_PLOT:
        os.environ["FRAMEWORK_PLOT_METRICS"] = "0"
    if name in ("quiet", "defaults", NO_PLOT):
        from overhead import EPOCH_STARTS, TRAINING_END, framework_loop

        seconds = framework_loop(data, epochs, "sp", output_dir, quiet=name == "quiet", hidden=hidden)
        return seconds, _since_second_epoch(EPOCH_STARTS, TRAINING_END[0])
    if hidden != 64:
        raise SystemExit(f"--hidden {hidden}: only raw, quiet and defaults take another width")
    return PEER_LOOPS[name](data, epochs, output_dir)


def _wait_for_background_plot() -> None:
    """Join the framework's background ``metrics.png`` drawing (where this child imported the
    framework): the process waits for it at exit anyway, so the whole-process time includes it;
    joined here so the drawing does not race the removal of the child's temporary directory."""
    plots = sys.modules.get("framework.metrics.background_plot")
    if plots is not None:
        plots.wait_for_plots()


def _import_first_step_modules() -> None:
    """One AdamW step on a throwaway parameter: the modules a first optimizer imports
    (``torch._dynamo``, about 0.7 s) are loaded before either side's timer starts."""
    import torch

    parameter = torch.nn.Parameter(torch.zeros(1))
    parameter.grad = torch.zeros(1)
    torch.optim.AdamW([parameter]).step()


def _since_second_epoch(epoch_starts: List[float], end: float) -> float:
    return end - epoch_starts[1] if len(epoch_starts) > 1 else 0.0


def _raw_loop(data, epochs: int, hidden: int = 64) -> Tuple[float, float]:
    """The hand-written loop with plain torch (no framework import), timed as ``train()`` is: from
    building the optimizer, sampler and loader to the last step."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from overhead import BATCH, make_net

    from backends import ResumableSampler

    net = make_net(hidden=hidden)
    start = time.perf_counter()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sampler = ResumableSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    epoch_starts = []
    for epoch in range(epochs):
        epoch_starts.append(time.perf_counter())
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return end - start, _since_second_epoch(epoch_starts, end)


def _peer_loop(net, optimizer, loader, backward: Callable[[Any], None], epochs: int) -> Tuple[float, float]:
    """The loop a peer's user writes (Fabric, Accelerate), with the peer's ``backward``, timed
    as :func:`_raw_loop` is from here on."""
    import torch.nn.functional as F

    start, epoch_starts = time.perf_counter(), []
    for _ in range(epochs):
        epoch_starts.append(time.perf_counter())
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return end - start, _since_second_epoch(epoch_starts, end)


def _fabric_loop(data, epochs: int, output_dir: str) -> Tuple[float, float]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from overhead import BATCH, make_net

    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    return _peer_loop(net, optimizer, loader, fabric.backward, epochs)


def _lightning_loop(data, epochs: int, output_dir: str) -> Tuple[float, float]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from overhead import BATCH, make_net

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    epoch_starts: List[float] = []

    class EpochClock(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            epoch_starts.append(time.perf_counter())

    trainer = L.Trainer(
        callbacks=[EpochClock()],
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=output_dir,
    )
    module, loader = Module(), DataLoader(data, batch_size=BATCH, shuffle=True)
    start = time.perf_counter()
    trainer.fit(module, loader)
    end = time.perf_counter()
    return end - start, _since_second_epoch(epoch_starts, end)


def _accelerate_loop(data, epochs: int, output_dir: str) -> Tuple[float, float]:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from overhead import BATCH, make_net

    accelerator = Accelerator(cpu=True)
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True))
    return _peer_loop(net, optimizer, loader, accelerator.backward, epochs)


PEER_LOOPS: Dict[str, Callable[..., Tuple[float, float]]] = {
    "fabric": _fabric_loop,
    "lightning": _lightning_loop,
    "accelerate": _accelerate_loop,
}


# -- the parent: fresh processes, alternating --------------------------------------------------
def user_environment() -> Dict[str, str]:
    """The environment of a user's fresh process: one OpenMP thread, this checkout first on the
    path, and bytecode caching on (Python's default; a sandbox's ``PYTHONDONTWRITEBYTECODE=1``
    would make every run compile the framework's modules from source, while torch's come
    precompiled from its wheel). The framework and backends are compiled once, untimed, first."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    if not _COMPILED:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "framework", "backends"], cwd=ROOT, env=environment, check=True)
        _COMPILED.append(True)
    return environment


_COMPILED: List[bool] = []


def run_process_output(arguments: Sequence[str]) -> Tuple[float, str]:
    """Run ``python ARGUMENTS`` in a fresh process (one OpenMP thread); return its wall seconds and its stdout."""
    environment = user_environment()
    start = time.perf_counter()
    finished = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=environment, cwd=ROOT)
    seconds = time.perf_counter() - start
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    return seconds, finished.stdout


def run_process(arguments: Sequence[str]) -> Tuple[float, str]:
    """Run ``python ARGUMENTS`` in a fresh process; return its wall seconds and its last stdout line."""
    seconds, output = run_process_output(arguments)
    lines = output.strip().splitlines()
    return seconds, lines[-1] if lines else ""


def json_objects(output: str) -> List[Dict[str, float]]:
    """The flat JSON objects in a job's stdout (ranks sharing one pipe may write them on one line)."""
    return [json.loads(text) for text in re.findall(r"\{[^{}\n]*\}", output)]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least-squares slope and intercept of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def measure_imports(repeats: int) -> Tuple[float, float]:
    """Median wall seconds of a fresh ``import torch`` and of a fresh ``import framework``."""
    torch_times, framework_times = [], []
    for _ in range(repeats):
        torch_times.append(run_process(["-c", "import torch"])[0])
        framework_times.append(run_process(["-c", "import framework"])[0])
    return statistics.median(torch_times), statistics.median(framework_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; every runner and epoch count once per round")
    parser.add_argument(
        "--epochs", type=int, nargs="+", default=[1, 2, 4], help="run lengths (256 steps per epoch; one length: no slope)"
    )
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=(*RUNNERS, NO_PLOT))
    parser.add_argument("--hidden", type=int, default=64, help="MLP width (raw, quiet and defaults only)")
    parser.add_argument("--child", choices=(*RUNNERS, NO_PLOT), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if not options.child and max(options.epochs) < 2:
        parser.error(f"--epochs needs a run of 2 or more epochs (the steady part starts at the second), got {options.epochs}")
    if options.child:
        with tempfile.TemporaryDirectory() as output_dir:
            train_seconds, steady_seconds = _child(options.child, options.epochs[0], output_dir, options.hidden)
            _wait_for_background_plot()  # before its directory goes (the process would wait at exit anyway)
            print(json.dumps({"train_seconds": train_seconds, "steady_seconds": steady_seconds}))
        return
    runners = [name for name in options.runners if name not in PEERS or importlib.util.find_spec(PEERS[name])]
    skipped = sorted(set(options.runners) - set(runners))
    if skipped:
        print(f"not installed, left out: {', '.join(skipped)} (pip install -e '.[bench]')")
    process: Dict[Tuple[str, int], List[float]] = {}
    training: Dict[Tuple[str, int], List[float]] = {}
    steady: Dict[Tuple[str, int], List[float]] = {}
    for _ in range(options.repeats):
        for epochs in options.epochs:
            for name in runners:
                seconds, line = run_process([__file__, "--child", name, "--epochs", str(epochs), "--hidden", str(options.hidden)])
                reported = json.loads(line)
                process.setdefault((name, epochs), []).append(seconds)
                training.setdefault((name, epochs), []).append(reported["train_seconds"])
                steady.setdefault((name, epochs), []).append(reported["steady_seconds"] / (256 * (epochs - 1) or 1))
    steps = [256 * epochs for epochs in options.epochs]
    longest = max(options.epochs)
    print(f"{options.repeats} rounds, fresh processes alternating; medians; 1 torch thread; steps per run {steps}")
    header = [("us/step", 9), ("ratio", 7), ("fixed s", 9), ("ratio", 7), ("process s", 11), ("ratio", 7)]
    header += [("train s", 9), ("ratio", 7), ("steady us/step", 16), ("ratio", 7), ("paired", 8)]
    print(f"{'runner':<11}" + "".join(f"{title:>{width}}" for title, width in header))
    reference: Dict[str, float] = {}
    for name in runners:
        medians = [statistics.median(process[(name, epochs)]) for epochs in options.epochs]
        slope, intercept = fit_line(steps, medians) if len(set(steps)) > 1 else (float("nan"), float("nan"))
        whole = statistics.median(process[(name, longest)])
        train = statistics.median(training[(name, longest)])
        per_step = statistics.median(steady[(name, longest)])
        figures = {"slope": slope, "intercept": intercept, "whole": whole, "train": train, "steady": per_step}
        reference = reference or figures
        ratios = {key: value / reference[key] if reference[key] > 0 else float("nan") for key, value in figures.items()}
        paired = statistics.median(a / b for a, b in zip(steady[(name, longest)], steady[(runners[0], longest)]))
        print(
            f"{name:<11}{1e6 * slope:>9.1f}{ratios['slope']:>7.3f}{intercept:>9.3f}{ratios['intercept']:>7.3f}"
            f"{whole:>11.3f}{ratios['whole']:>7.3f}{train:>9.3f}{ratios['train']:>7.3f}"
            f"{1e6 * per_step:>16.1f}{ratios['steady']:>7.3f}{paired:>8.3f}"
        )
    print(
        f"(process s and train s: the {256 * longest}-step run; steady us/step: from its second epoch's start to its end, "
        f"and paired: the median of the per-round ratios; ratios to the first runner, {runners[0]})"
    )
    torch_seconds, framework_seconds = measure_imports(options.repeats)
    print(
        f"import torch {torch_seconds:.3f} s, import framework {framework_seconds:.3f} s: "
        f"+{framework_seconds - torch_seconds:.3f} s (target <= 0.25)"
    )


if __name__ == "__main__":
    main()
