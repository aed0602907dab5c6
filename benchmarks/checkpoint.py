"""Checkpoint cost for a ~100M-parameter model: training stall of sync vs async saves, and resume time.

A stack of ``Linear(2048, 2048)`` layers (100.7M parameters, SGD with momentum: a checkpoint
of ~806 MB) trains with the ``sp`` backend while :class:`DefaultCheckpointer` saves every
``--every`` optimizer steps into a temporary directory (removed at the end).

- Stall of a save: how long ``Trainer.save_checkpoint`` blocks the training loop (building
  the state, and either writing it or copying it to CPU memory for the background thread).
  Target: async stall <= 25% of sync stall.
- Time lost per save: the sum, over the steps from a save to the next one, of (step interval
  - the median step of a run without saves). It adds, for async saves, the slowdown of
  training while the background thread writes (CPU and memory bandwidth it takes). On a
  busy shared machine this figure is noisy.
- Resume time: from ``Trainer.train()`` to the first hook of the resumed run (``on_begin_train``):
  listing, CRC check, ``torch.load(weights_only=True)``, restoring model and optimizer.

    python benchmarks/checkpoint.py [--layers 24] [--every 10] [--saves 3] [--no-write-docs]

The figures are written under the "Checkpointing" heading of docs/benchmarks.md.
"""

import argparse
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from framework import ModuleInterface, Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402
from framework.checkpoint import DefaultCheckpointerArguments  # noqa: E402

WIDTH, BATCH, SAMPLES = 2048, 4, 64


class LinearStack(ModuleInterface):
    """``layers`` x Linear(2048, 2048) with ReLU, trained on random regression data."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: List[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*blocks[:-1])
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(SAMPLES, WIDTH, generator=generator), torch.randn(SAMPLES, WIDTH, generator=generator))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.mse_loss(self.net(x), y)


class TimedTrainer(Trainer):
    """A Trainer that records how long each ``save_checkpoint`` call blocks the training loop."""

    def __init__(self, *arguments: Any, **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        self.save_durations: List[float] = []

    def save_checkpoint(self, index: Optional[int] = None, force: bool = True) -> Optional[str]:
        started = time.perf_counter()
        location = super().save_checkpoint(index, force)
        self.save_durations.append(time.perf_counter() - started)
        return location


class StepClock(Callback):
    """Timestamps every optimizer step (before the trainer's save at that step) and the run's start."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.begin: Optional[float] = None
        self.save_durations: List[float] = []

    def on_begin_train(self, global_step: int) -> None:
        self.begin = time.perf_counter()

    def on_end_optimizer_step(self, global_step: int) -> None:
        self.times.append(time.perf_counter())


def train(module: LinearStack, directory: str, steps: int, every: Optional[int], async_save: bool = False, **extra: Any) -> StepClock:
    clock = StepClock()
    checkpointer = DefaultCheckpointerArguments(
        save_dir=directory, period=0, save_every_n_steps=every, save_at_end=False, async_save=async_save, **extra
    )
    args = TrainerArguments(
        epochs=10**6, max_steps=steps, train_batch_size=BATCH, disable_tqdm=True, log_level="WARNING",
        log_every_n_steps=10**6, val_every_n_epochs=0, output_dir=os.path.join(directory, "out"), checkpointer_args=checkpointer,
    )
    trainer = TimedTrainer(module, args, callbacks=[clock])
    trainer.train()
    trainer.close()
    clock.save_durations = trainer.save_durations
    return clock


def stalls(clock: StepClock, every: int, baseline: float) -> List[float]:
    """Extra seconds lost to each save: intervals from the save's step to the next save, minus baseline."""
    intervals = [b - a for a, b in zip(clock.times, clock.times[1:])]  # intervals[k-1]: from step k to k+1
    result = []
    for save_step in range(every, len(clock.times), every):
        window = intervals[save_step - 1 : save_step - 1 + every]
        if len(window) == every:
            result.append(sum(window) - every * baseline)
    return result


def measure(layers: int, every: int, saves: int, directory: str) -> Dict[str, float]:
    module = LinearStack(layers)
    parameters = sum(p.numel() for p in module.parameters())
    warmup = 3
    steps = every * (saves + 1)

    plain = train(module, os.path.join(directory, "plain"), steps=min(steps, warmup + 2 * every), every=None)
    baseline = statistics.median(b - a for a, b in zip(plain.times[warmup:], plain.times[warmup + 1 :]))

    sync_dir = os.path.join(directory, "sync")
    sync = train(module, sync_dir, steps=steps, every=every)
    size = max(os.path.getsize(os.path.join(sync_dir, name)) for name in os.listdir(sync_dir) if name.endswith(".pt"))
    shutil.rmtree(os.path.join(directory, "sync", "out"), ignore_errors=True)
    gc.collect()

    async_dir = os.path.join(directory, "async")
    asynchronous = train(module, async_dir, steps=steps, every=every, async_save=True)
    shutil.rmtree(async_dir, ignore_errors=True)
    gc.collect()

    # Resume: a fresh module and trainer load the newest synchronous checkpoint.
    del module
    gc.collect()
    resume_times = []
    for _ in range(2):
        fresh = LinearStack(layers)
        started = time.perf_counter()
        clock = train(fresh, sync_dir, steps=steps, every=None, resume="auto")  # already at max_steps: no training
        resume_times.append(clock.begin - started)
        del fresh
        gc.collect()
    return {
        "parameters": parameters,
        "checkpoint_mb": size / 1e6,
        "step_s": baseline,
        "sync_stall_s": statistics.median(sync.save_durations),
        "async_stall_s": statistics.median(asynchronous.save_durations),
        "async_first_stall_s": asynchronous.save_durations[0],
        "sync_lost_s": statistics.median(stalls(sync, every, baseline)),
        "async_lost_s": statistics.median(stalls(asynchronous, every, baseline)),
        "resume_s": min(resume_times),
    }


def report(figures: Dict[str, float], every: int, saves: int) -> str:
    ratio = figures["async_stall_s"] / figures["sync_stall_s"]
    verdict = "meets" if ratio <= 0.25 else "misses"
    return (
        f"`python benchmarks/checkpoint.py` on {os.cpu_count()} CPU cores (torch {torch.__version__}, local disk, "
        f"fsync on): a stack of Linear(2048, 2048) layers, {figures['parameters'] / 1e6:.1f}M parameters, SGD with "
        f"momentum, checkpoint {figures['checkpoint_mb']:.0f} MB; a save every {every} optimizer steps, median of "
        f"{saves} saves; one training step takes {figures['step_s'] * 1000:.0f} ms.\n\n"
        "| measure | seconds |\n|---|---|\n"
        f"| training stall of a synchronous save | {figures['sync_stall_s']:.2f} |\n"
        f"| training stall of an asynchronous save (`async_save=True`) | {figures['async_stall_s']:.2f} "
        f"(first save, allocating its buffers: {figures['async_first_stall_s']:.2f}) |\n"
        f"| async / sync stall | {ratio:.0%} (target <= 25%: {verdict}) |\n"
        f"| time lost per save, sync (stall + effect on the following steps) | {figures['sync_lost_s']:.2f} |\n"
        f"| time lost per save, async (stall + slowdown while the background write runs) | {figures['async_lost_s']:.2f} |\n"
        f"| resume: `train()` to the first hook, newest checkpoint verified and loaded | {figures['resume_s']:.2f} |\n\n"
        "Stall: wall time of `Trainer.save_checkpoint` on the training thread (building the state, then writing "
        "it, or copying it into reused CPU buffers for the background writer). Time lost: the steps from a save "
        "to the next one, minus the same number of median steps of a run without saves; noisy on a shared machine.\n"
    )


def write_docs(section: str) -> str:
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = "## Checkpointing\n\n" + section
    pattern = re.compile(r"^## Checkpointing\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as handle:
        handle.write(text.rstrip("\n") + "\n")
    return path


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="Linear(2048, 2048) layers (24: 100.7M parameters)")
    parser.add_argument("--every", type=int, default=8, help="optimizer steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="saves measured per mode")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory (default: the system's)")
    parser.add_argument("--no-write-docs", action="store_true", help="print only")
    options = parser.parse_args(argv)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="checkpoint-benchmark-", dir=options.dir)
    try:
        figures = measure(options.layers, options.every, options.saves, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    section = report(figures, options.every, options.saves)
    print(section)
    if not options.no_write_docs:
        print(f"written to {write_docs(section)}")


if __name__ == "__main__":
    main()
