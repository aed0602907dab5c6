"""What ``train()`` costs outside its steps, part by part, and the time to the first step.

Every run is a fresh process started as a user starts one: ``python`` for ``sp``, ``torchrun
--standalone --nproc_per_node=N`` (gloo on CPU) for ``ddp`` on 1, 2 and 4 processes, each beside
the hand-written loop that does the same work (``raw``: plain torch, ``DistributedDataParallel``
under torchrun), alternating within a round, the order reversed every other round. The workload is
the MLP of ``overhead.py`` (32-64-64-10, batch 32 per process, AdamW, one torch thread per process)
for 2 epochs of 64 steps, with a validation pass (512 samples) and a checkpoint after each epoch:
the hand-written loop validates and saves (``torch.save`` to a temporary name, renamed) as the
framework's defaults do. The framework runs at its defaults (progress bar, logging every 50
steps, sanity validation, config.yaml, the run lock, metrics.csv, metrics.png at the end).

Inside the framework's process each part of ``train()`` is timed by wrapping the method that does
it (self time: a part nested in another is counted once, in the inner one):

- ``import framework`` (after ``import torch``, which both runners pay), ``Trainer()`` (of it, the
  backend's set-up: the process group under ddp);
- in ``train()``: claim and lock (``version_N``, the lock file, its release), build (loader,
  wrapped module, optimizers), callbacks' set-up, restore (looking for a checkpoint to resume),
  loggers (start and finish), config.yaml and the run-id record, sanity validation, loader start
  (each epoch's iterator), the steps, epoch ends (epoch metrics, validation), the first save, the
  later saves, end-of-run hooks (``on_end_train``: the plot's hand-off), and what is left (the
  loop between steps: logging, checks);
- after ``train()``: the process's exit (joining the drawing of metrics.png, the process group).

The time to first step is from the parent's start of the process (``python`` or ``torchrun``) to
the end of the first optimizer step on the slowest rank (its wall clock, ``time.time()``). The
breakdown is rank zero's (it writes the files). The load average is printed before and after:
absolute seconds on a loaded machine are not a quiet machine's; the differences, measured in the
same rounds, are what to read.

    python benchmarks/fixed_cost.py [--repeats 5] [--sizes 1 2 4] [--no-sp]

Targets (issue 53): time to first step within 0.5 s of the hand-written loop at every size.
Figures: docs/benchmarks.md, "Fixed costs".
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Sequence

STARTED = time.time()  # before any import: the interpreter's own start-up is the parent's launch to here
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS_PER_EPOCH, EPOCHS, BATCH, VAL_SAMPLES = 64, 2, 32, 512
PARTS = (
    "import framework",
    "Trainer(): backend set-up (process group)",
    "Trainer(): the rest",
    "claim and lock",
    "build: loader, wrapped module, optimizers",
    "callbacks' set-up",
    "restore (resume lookup)",
    "loggers (start, finish)",
    "config.yaml and run-id writes",
    "sanity validation",
    "loader start (per epoch)",
    "steps",
    "epoch ends (metrics, validation)",
    "first save",
    "later saves",
    "end-of-run hooks",
    "train(): the rest (loop, logging)",
    "process exit (plot join, teardown)",
)


# -- the children -----------------------------------------------------------------------------
class PartTimer:
    """Self time per part: each wrapped call's time less the wrapped calls inside it."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self._inner: List[float] = []

    def wrap(self, owner: Any, name: str, part: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            label = part(*args)
            if not label:
                return original(*args, **kwargs)
            start = time.perf_counter()
            self._inner.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed, inner = time.perf_counter() - start, self._inner.pop()
                self.seconds[label] += elapsed - inner
                self.calls[label] += 1
                if self._inner:
                    self._inner[-1] += elapsed

        setattr(owner, name, timed)


def _data(samples: int, seed: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=generator)
    return TensorDataset(x, (x @ torch.randn(32, 10, generator=torch.Generator().manual_seed(0))).argmax(1))


def _make_net() -> Any:
    """The MLP of ``overhead.py`` (32-64-64-10, seeded), built here: importing ``overhead`` imports the
    framework, which the hand-written loop must not pay and the framework's timer must see."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)]
    return torch.nn.Sequential(*layers)


def _raw_child(world: int) -> Dict[str, float]:
    """The hand-written loop: process group (under torchrun), DDP, train, validate, save per epoch."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    torch.set_num_threads(1)
    rank, marks = int(os.environ.get("RANK", "0")), {"imported": time.time()}
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    train_data, val_data = _data(STEPS_PER_EPOCH * BATCH * world, 1), _data(VAL_SAMPLES, 2)
    net = _make_net()
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(train_data, seed=0) if distributed else RandomSampler(train_data)
    loader = DataLoader(train_data, batch_size=BATCH, sampler=sampler)
    val_loader = DataLoader(val_data, batch_size=BATCH)
    output_dir = tempfile.mkdtemp()
    marks["train_start"] = time.time()
    for epoch in range(EPOCHS):
        if distributed:
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            marks.setdefault("first_step", time.time())
        model.eval()
        with torch.no_grad():
            total = sum(F.cross_entropy(net(x), y, reduction="sum") for x, y in val_loader)
        if rank == 0:
            print(f"epoch {epoch}: val loss {float(total) / VAL_SAMPLES:.4f}", file=sys.stderr)
            path = os.path.join(output_dir, f"checkpoint-{epoch}.pt")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path + ".tmp")
            os.replace(path + ".tmp", path)
    marks["train_end"] = time.time()
    if distributed:
        dist.destroy_process_group()
    return marks


def _framework_child(world: int, backend: str) -> Dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    marks = {"imported": time.time()}
    start = time.perf_counter()
    import framework.loop.trainer as trainer_module
    from backends.base import TrainerBackend
    from framework import ModuleInterface, Trainer, TrainerArguments

    timer = PartTimer()
    timer.seconds["import framework"] = time.perf_counter() - start
    train_data, val_data = _data(STEPS_PER_EPOCH * BATCH * world, 1), _data(VAL_SAMPLES, 2)

    class Module(ModuleInterface):
        def __init__(self) -> None:
            super().__init__()
            self.net = _make_net()

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.AdamW(self.parameters(), lr=1e-3)], []

        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(train_data, batch_size=batch_size, sampler=sampler(train_data))

        def get_val_dataloaders(self, sampler, batch_size):
            return DataLoader(val_data, batch_size=batch_size, sampler=sampler(val_data))

        def train_step(self, global_step, batch, device):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def val_step(self, global_step, batch, device):
            x, y = batch
            return F.cross_entropy(self.net(x), y, reduction="none")

    timer.wrap(TrainerBackend, "setup", lambda *_: "Trainer(): backend set-up (process group)")
    output_dir = tempfile.mkdtemp()
    args = TrainerArguments(epochs=EPOCHS, train_batch_size=BATCH * world, backend=backend, seed=0, output_dir=output_dir)
    args.use_gpu = False
    start = time.perf_counter()
    trainer = Trainer(Module(), args)
    constructed = time.perf_counter() - start
    timer.seconds["Trainer(): the rest"] = constructed - timer.seconds["Trainer(): backend set-up (process group)"]
    for owner, names, part in (
        (trainer.run_claim, ("move_if_taken", "lock", "claim_directory", "release"), "claim and lock"),
        (trainer.run_start, ("prepare_callbacks",), "callbacks' set-up"),
        (trainer.checkpoint_manager, ("restore",), "restore (resume lookup)"),
        (trainer.recorder, ("start_loggers",), "loggers (start, finish)"),
        (trainer.recorder.loggers, ("finish",), "loggers (start, finish)"),
        (trainer.run_start, ("_write_config",), "config.yaml and run-id writes"),
        (trainer_module, ("run_sanity_check",), "sanity validation"),
        (trainer, ("_start_epoch",), "loader start (per epoch)"),
        (trainer, ("_end_epoch",), "epoch ends (metrics, validation)"),
        (trainer.checkpointer, ("wait",), "later saves"),
    ):
        for name in names:
            timer.wrap(owner, name, lambda *_, part=part: part)
    timer.wrap(trainer, "save_checkpoint", lambda *_: "later saves" if timer.calls["first save"] else "first save")
    timer.wrap(trainer.hooks, "call", lambda name, *_: "end-of-run hooks" if name == "on_end_train" else "")
    real_build = trainer.training_setup.build

    def build(*arguments: Any) -> Any:  # the step is chosen when training is built: time it from then on
        result = real_build(*arguments)
        real_run = trainer.training_step.run

        def run(*arguments: Any) -> Any:
            micro_batches = real_run(*arguments)
            marks.setdefault("first_step", time.time())
            return micro_batches

        trainer.training_step.run = run
        timer.wrap(trainer.training_step, "run", lambda *_: "steps")
        return result

    trainer.training_setup.build = build  # type: ignore[method-assign]
    timer.wrap(trainer.training_setup, "build", lambda *_: "build: loader, wrapped module, optimizers")
    marks["train_start"] = time.time()
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    marks["train_end"] = time.time()
    inside = sum(seconds for part, seconds in timer.seconds.items() if part not in PARTS[:3])
    timer.seconds["train(): the rest (loop, logging)"] = train_seconds - inside
    marks.update({f"part:{part}": seconds for part, seconds in timer.seconds.items()})
    marks["train_seconds"] = train_seconds
    return marks


def child(runner: str, backend: str, out: str) -> None:
    sys.path[:0] = [HERE, ROOT]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    marks = _raw_child(world) if runner == "raw" else _framework_child(world, backend)
    marks["script_start"] = STARTED
    marks["framework_imported"] = float("framework" in sys.modules)  # the hand-written loop never imports it
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:  # the benchmark's own scratch file
        json.dump(marks, handle)


# -- the parent -------------------------------------------------------------------------------
def launch(runner: str, size: int) -> Dict[str, Any]:
    """One fresh run: ``python`` (size 0: sp) or ``torchrun`` of ``size`` processes (ddp)."""
    from fresh_process import user_environment

    environment = user_environment()
    with tempfile.TemporaryDirectory() as out:
        script = [os.path.abspath(__file__), "--child", runner, "--backend", "ddp" if size else "sp", "--out", out]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}"] if size else []
        launched = time.time()
        finished = subprocess.run([sys.executable, *launcher, *script], capture_output=True, text=True, env=environment, cwd=ROOT)
        ended = time.time()
        if finished.returncode != 0:
            raise SystemExit(f"{runner} on {size or 'sp'} failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
        ranks = []
        for name in sorted(os.listdir(out), key=lambda name: int(name[4:-5])):  # rank0.json first
            with open(os.path.join(out, name)) as handle:
                ranks.append(json.load(handle))
    zero = ranks[0]
    result = {
        "first step": max(marks["first_step"] for marks in ranks) - launched,
        "whole process": ended - launched,
        "interpreter and import torch": zero["imported"] - launched,
        "set-up before training": zero["train_start"] - zero["imported"],
        "train call": zero["train_end"] - zero["train_start"],
        "exit": ended - max(marks["train_end"] for marks in ranks),
    }
    result.update({key[5:]: value for key, value in zero.items() if key.startswith("part:")})
    if runner != "raw":
        result["process exit (plot join, teardown)"] = result["exit"]
    return result


def label(size: int) -> str:
    return f"ddp x{size} (torchrun)" if size else "sp (python)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="torchrun processes for ddp")
    parser.add_argument("--no-sp", action="store_true", help="leave out the single-process (python, sp) runs")
    parser.add_argument("--child", choices=("raw", "framework"), help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="sp", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        return child(options.child, options.backend, options.out)
    for size in options.sizes:
        if size < 1:
            raise SystemExit(f"--sizes {size}: a process count is an integer >= 1")
    sys.path[:0] = [HERE, ROOT]
    sizes = ([] if options.no_sp else [0]) + options.sizes
    load_before = os.getloadavg()
    results: Dict[tuple, List[Dict[str, Any]]] = defaultdict(list)
    for round_index in range(options.repeats):
        order = ("raw", "framework") if round_index % 2 == 0 else ("framework", "raw")
        for size in sizes:
            for runner in order:
                results[runner, size].append(launch(runner, size))
        print(f"round {round_index + 1}/{options.repeats} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    report(results, sizes, options.repeats, load_before, os.getloadavg())


def _median(runs: Sequence[Dict[str, Any]], key: str) -> float:
    return statistics.median(run.get(key, 0.0) for run in runs)


def report(results: Dict[tuple, List[Dict[str, Any]]], sizes: List[int], repeats: int, before: tuple, after: tuple) -> None:
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(*before, *after))
    print(f"{os.cpu_count()} CPUs; medians of {repeats} fresh processes per cell, runners alternating\n")
    print("## Time to first step (launch to the end of the first optimizer step, slowest rank), s\n")
    print("| run | hand-written | framework | difference | paired difference | target <= 0.5 s |\n|---|---|---|---|---|---|")
    for size in sizes:
        raw, own = results["raw", size], results["framework", size]
        difference = _median(own, "first step") - _median(raw, "first step")
        paired = statistics.median(a["first step"] - b["first step"] for a, b in zip(own, raw))
        verdict = "met" if paired <= 0.5 else "not met"
        row = f"{_median(raw, 'first step'):.3f} | {_median(own, 'first step'):.3f} | {difference:+.3f} | {paired:+.3f}"
        print(f"| {label(size)} | {row} | {verdict} |")
    print("\n## The whole process, s (hand-written / framework)\n")
    print("| run | interpreter + import torch | set-up before training | train call | exit | whole process | ratio |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        raw, own = results["raw", size], results["framework", size]
        cells = [
            f"{_median(raw, key):.3f} / {_median(own, key):.3f}"
            for key in ("interpreter and import torch", "set-up before training", "train call", "exit", "whole process")
        ]
        print(f"| {label(size)} | {' | '.join(cells)} | {_median(own, 'whole process') / _median(raw, 'whole process'):.3f} |")
    print("\n## The framework's parts, ms (self time, rank zero; medians)\n")
    print("| part | " + " | ".join(label(size) for size in sizes) + " |\n|---|" + "---|" * len(sizes))
    for part in PARTS:
        print(f"| {part} | " + " | ".join(f"{1e3 * _median(results['framework', size], part):.1f}" for size in sizes) + " |")
    print(
        "| (hand-written: train call, steps to saves included) | "
        + " | ".join(f"{1e3 * _median(results['raw', size], 'train call'):.1f}" for size in sizes)
        + " |"
    )


if __name__ == "__main__":
    main()
