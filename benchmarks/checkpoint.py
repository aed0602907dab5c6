"""Checkpoint cost for a ~100M-parameter model: training stall of sync vs async saves, and resume time.

A stack of ``Linear(2048, 2048)`` layers (100.7M parameters, SGD with momentum: a checkpoint
of ~806 MB) trains with the ``sp`` backend while :class:`DefaultCheckpointer` saves every
``--interval`` seconds of training into a temporary directory (removed at the end).

- Stall of a save: how long ``Trainer.save_checkpoint`` blocks the training loop (building
  the state, and either writing it or copying it to CPU memory for the background thread).
  Target: async stall <= 25% of sync stall.
- Background write: how long the writer thread takes, and the median training step while
  it runs against the median step of a run without saves (the CPU and memory bandwidth the
  write takes from training). On a busy shared machine these figures are noisy.
- Resume time: from ``Trainer.train()`` to the first hook of the resumed run (``on_begin_train``):
  listing, CRC check, ``torch.load(weights_only=True)``, restoring model and optimizer.

    python benchmarks/checkpoint.py [--layers 24] [--interval 10] [--saves 4] [--no-write-docs]

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
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from framework import ModuleInterface, Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback, StopTraining  # noqa: E402
from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments  # noqa: E402

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
        self.data = TensorDataset(
            torch.randn(SAMPLES, WIDTH, generator=generator), torch.randn(SAMPLES, WIDTH, generator=generator)
        )

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
        if location is not None:  # epoch ends call it too; with period=0 nothing is saved there
            self.save_durations.append(time.perf_counter() - started)
        return location


class TimedCheckpointer(DefaultCheckpointer):
    """Records how long each save waited for the previous background write, and when writes ran."""

    def __init__(self, *arguments: Any, niceness: Optional[int] = None, **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        if niceness is not None:
            self._writer.niceness = niceness
        self.waits: List[float] = []
        self.writes: List[Tuple[float, float]] = []
        write = self._io.write

        def timed_write(path: str, obj: Any) -> None:  # the file write, on the training or the writer thread
            started = time.perf_counter()
            write(path, obj)
            self.writes.append((started, time.perf_counter()))

        self._io.write = timed_write  # type: ignore[method-assign]

    def save(self, checkpoint: Any, epoch: int, force: bool = False) -> Optional[str]:
        if force:  # the benchmark's saves; epoch ends (force=False, period=0) save nothing and do not wait
            started = time.perf_counter()
            self.wait()
            self.waits.append(time.perf_counter() - started)
        return super().save(checkpoint, epoch, force)


class StepClock(Callback):
    """Timestamps every optimizer step and the run's start; with ``interval``, also saves.

    A save is requested at the first optimizer step ``interval`` seconds after the previous
    save returned (so the background write of an async save has time to finish, as with
    real checkpoint intervals of minutes); after ``saves`` saves and one more interval the
    run stops.
    """

    def __init__(self, interval: Optional[float] = None, saves: int = 0) -> None:
        self.interval, self.saves = interval, saves
        self.times: List[float] = []
        self.begin: Optional[float] = None
        self.trainer: Any = None
        self.save_durations: List[float] = []
        self.checkpointer: Any = None
        self._last = 0.0

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_begin_train(self, global_step: int) -> None:
        self.begin = self._last = time.perf_counter()

    def on_end_optimizer_step(self, global_step: int) -> None:
        now = time.perf_counter()
        self.times.append(now)
        if self.interval is None or now - self._last < self.interval:
            return
        if len(self.trainer.save_durations) >= self.saves:
            raise StopTraining("benchmark done", save_checkpoint=False)
        self.trainer.save_checkpoint()
        self._last = time.perf_counter()


def train(
    module: LinearStack,
    directory: str,
    max_steps: int,
    interval: Optional[float] = None,
    saves: int = 0,
    async_save: bool = False,
    niceness: Optional[int] = None,
    **extra: Any,
) -> StepClock:
    clock = StepClock(interval, saves)
    checkpointer = DefaultCheckpointerArguments(save_dir=directory, period=0, save_at_end=False, async_save=async_save, **extra)
    args = TrainerArguments(
        epochs=10**6,
        max_steps=max_steps,
        train_batch_size=BATCH,
        disable_tqdm=True,
        log_level="WARNING",
        log_every_n_steps=10**6,
        val_every_n_epochs=0,
        output_dir=os.path.join(directory, "out"),
        checkpointer_args=checkpointer,
    )
    timed = TimedCheckpointer(checkpointer, niceness=niceness)
    trainer = TimedTrainer(module, args, checkpointer=timed, callbacks=[clock])
    trainer.train()
    trainer.close()
    clock.save_durations, clock.checkpointer = trainer.save_durations, timed
    return clock


def steps_during_writes(clock: StepClock) -> List[float]:
    """Durations of the training steps that ran entirely while a background write was in flight."""
    durations = []
    for start, end in zip(clock.times, clock.times[1:]):
        if any(write_start <= start and end <= write_end for write_start, write_end in clock.checkpointer.writes):
            durations.append(end - start)
    return durations


def measure(layers: int, interval: float, saves: int, directory: str, niceness: Optional[int] = None) -> Dict[str, Any]:
    module = LinearStack(layers)
    parameters = sum(p.numel() for p in module.parameters())
    warmup, unlimited = 3, 10**9

    plain = train(module, os.path.join(directory, "plain"), max_steps=warmup + 12)
    baseline = statistics.median(b - a for a, b in zip(plain.times[warmup:], plain.times[warmup + 1 :]))

    sync_dir = os.path.join(directory, "sync")
    sync = train(module, sync_dir, max_steps=unlimited, interval=interval, saves=saves)
    names = sorted(name for name in os.listdir(sync_dir) if name.startswith("checkpoint-"))
    size = os.path.getsize(os.path.join(sync_dir, names[-1]))
    last_step = int(names[-1][len("checkpoint-") : -len(".pt")])
    shutil.rmtree(os.path.join(sync_dir, "out"), ignore_errors=True)
    gc.collect()

    async_dir = os.path.join(directory, "async")
    asynchronous = train(
        module, async_dir, max_steps=unlimited, interval=interval, saves=saves, async_save=True, niceness=niceness
    )
    shutil.rmtree(async_dir, ignore_errors=True)
    del module
    gc.collect()

    # Resume: a fresh module and trainer load the newest synchronous checkpoint (already at max_steps: no training).
    resume_times = []
    for _ in range(2):
        fresh = LinearStack(layers)
        started = time.perf_counter()
        clock = train(fresh, sync_dir, max_steps=last_step, resume="auto")
        resume_times.append(clock.begin - started)
        del fresh
        gc.collect()
    later_async = asynchronous.save_durations[1:] or asynchronous.save_durations
    return {
        "parameters": parameters,
        "checkpoint_mb": size / 1e6,
        "step_s": baseline,
        "sync_stall_s": statistics.median(sync.save_durations),
        "async_stall_s": statistics.median(later_async),
        "async_first_stall_s": asynchronous.save_durations[0],
        "async_wait_s": max(asynchronous.checkpointer.waits),
        "sync_write_s": statistics.median(end - start for start, end in sync.checkpointer.writes),
        "async_write_s": statistics.median(end - start for start, end in asynchronous.checkpointer.writes),
        "step_during_write_s": statistics.median(steps_during_writes(asynchronous) or [float("nan")]),
        "resume_s": min(resume_times),
        "raw": {
            "sync stalls": sync.save_durations,
            "async stalls": asynchronous.save_durations,
            "async waits for the previous write": asynchronous.checkpointer.waits,
            "async writes": [end - start for start, end in asynchronous.checkpointer.writes],
            "resume": resume_times,
        },
    }


def report(figures: Dict[str, float], interval: float, saves: int) -> str:
    ratio = figures["async_stall_s"] / figures["sync_stall_s"]
    verdict = "meets" if ratio <= 0.25 else "misses"
    return (
        f"`python benchmarks/checkpoint.py` on {os.cpu_count()} CPU cores (load average {figures['load'][0]:.1f} "
        f"before, {figures['load'][1]:.1f} after: other processes shared the machine; torch {torch.__version__}, "
        f"local disk, fsync on): a stack of Linear(2048, 2048) layers, {figures['parameters'] / 1e6:.1f}M parameters, SGD with "
        f"momentum, checkpoint {figures['checkpoint_mb']:.0f} MB; a save every {interval:g} s of training, {saves} "
        f"saves per mode (medians; async: saves after the first, which allocates its buffers); one training step "
        f"takes {figures['step_s'] * 1000:.0f} ms.\n\n"
        "| measure | seconds |\n|---|---|\n"
        f"| training stall of a synchronous save | {figures['sync_stall_s']:.2f} |\n"
        f"| training stall of an asynchronous save (`async_save=True`) | {figures['async_stall_s']:.2f} "
        f"(first save, allocating its buffers: {figures['async_first_stall_s']:.2f}) |\n"
        f"| async / sync stall | {ratio:.0%} (target <= 25%: {verdict}) |\n"
        f"| longest wait of an async save for the previous background write | {figures['async_wait_s']:.2f} |\n"
        "| write of one checkpoint: sync / async (background, lowered priority) "
        f"| {figures['sync_write_s']:.2f} / {figures['async_write_s']:.2f} |\n"
        "| training step without saves / while a background write runs "
        f"| {figures['step_s']:.2f} / {figures['step_during_write_s']:.2f} |\n"
        f"| resume: `train()` to the first hook, newest checkpoint verified and loaded | {figures['resume_s']:.2f} |\n\n"
        "Stall: wall time of `Trainer.save_checkpoint` on the training thread (building the state, then writing "
        "it, or copying it into reused CPU buffers for the background writer). Step times are medians; on a "
        "shared machine they move with the load of other processes.\n"
    )


def write_docs(section: str) -> str:
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as handle:
            text = handle.read()
    block = "## Checkpointing\n\n" + section
    pattern = re.compile(r"^## Checkpointing\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: block + "\n", text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as handle:
        handle.write(text.rstrip("\n") + "\n")
    return path


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="Linear(2048, 2048) layers (24: 100.7M parameters)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds of training between saves")
    parser.add_argument("--saves", type=int, default=4, help="saves measured per mode")
    parser.add_argument("--dir", default=None, help="parent of the temporary directory (default: the system's)")
    parser.add_argument("--writer-niceness", type=int, default=None, help="override the background writer's niceness")
    parser.add_argument("--no-write-docs", action="store_true", help="print only")
    options = parser.parse_args(argv)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="checkpoint-benchmark-", dir=options.dir)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    try:
        figures = measure(options.layers, options.interval, options.saves, directory, options.writer_niceness)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures["load"] = (load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
    section = report(figures, options.interval, options.saves)
    print(section)
    print("raw seconds:", {name: [round(value, 3) for value in values] for name, values in figures["raw"].items()})
    if not options.no_write_docs:
        print(f"written to {write_docs(section)}")


if __name__ == "__main__":
    main()
