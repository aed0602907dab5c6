"""Framework overhead on one process: the ``sp`` backend vs a hand-written PyTorch loop.

Both train the same MLP (32-64-64-10, batch 32, AdamW, in-memory data) for the same number
of steps, alternating runs in one process; the figures are the ratio of median wall times and
the median of the per-pair ratios, framework / raw (targets: <= 1.05 with the progress bar and
logging at their defaults, <= 1.03 with both and the end-of-run plot off: ``--quiet``).

    python benchmarks/overhead.py [--epochs 3] [--repeats 5] [--backend sp] [--quiet] [--clock cpu] [--profiler torch]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backends import ResumableSampler
from framework import ModuleInterface, Trainer, TrainerArguments

SAMPLES, FEATURES, CLASSES, BATCH = 8192, 32, 10, 32
CLOCK = [time.perf_counter]  # --clock cpu: this thread's CPU time (robust to a busy or shared machine)
EPOCH_STARTS: list = []  # perf_counter() at each epoch's start of the last framework_loop run (steady per-step figures)
TRAINING_END: list = []  # perf_counter() when its last epoch ended (``on_end_train``: before callbacks draw or save)


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1))


def make_net(features: int = FEATURES, hidden: int = 64) -> torch.nn.Module:
    """The benchmark MLP (features-hidden-hidden-10), with fixed initial weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def raw_loop(data: TensorDataset, epochs: int) -> float:
    """The hand-written loop a careful user would write."""
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sampler = ResumableSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    start = CLOCK[0]()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return CLOCK[0]() - start


class BenchmarkModule(ModuleInterface):
    """The benchmark MLP as a framework module (shared with ``ddp_overhead.py``)."""

    def __init__(self, data: TensorDataset, hidden: int = 64) -> None:
        super().__init__()
        self.net = make_net(data.tensors[0].shape[1], hidden)
        self.data = data

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-3)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_begin_train_epoch(self, global_step, epoch):
        EPOCH_STARTS.append(time.perf_counter())

    def on_end_train(self, global_step):
        TRAINING_END[:] = [time.perf_counter()]  # the module's hook runs before the callbacks'


def framework_loop(
    data: TensorDataset,
    epochs: int,
    backend: str,
    output_dir: str,
    quiet: bool = False,
    profiler: str = "off",
    hidden: int = 64,
) -> float:
    run_dir = tempfile.mkdtemp(dir=output_dir)  # a fresh directory per run: a run never reuses another's
    EPOCH_STARTS.clear()  # this run's epochs only (runs alternate in one process)
    TRAINING_END.clear()
    args = TrainerArguments(
        epochs=epochs, train_batch_size=BATCH, backend=backend, seed=0, output_dir=run_dir, use_gpu=False, profiler=profiler
    )
    if quiet:  # progress bar, step logging and the end-of-run plot off: the loop's own cost
        args.disable_tqdm, args.log_every_n_steps, args.log_level, args.plot_metrics = True, 10**9, "WARNING", False
    args.checkpointer_args.period = 0
    args.checkpointer_args.save_at_end = False
    trainer = Trainer(BenchmarkModule(data, hidden), args)
    start = CLOCK[0]()
    trainer.train()
    return CLOCK[0]() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="sp")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profiler", choices=("off", "throughput", "torch"), default="off", help="TrainerArguments.profiler")
    parser.add_argument("--quiet", action="store_true", help="progress bar and step logging off (target <= 1.03)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the training thread's CPU time (one thread, no loader workers: all the work is on it)",
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    if options.clock == "cpu":
        if options.threads != 1:
            raise SystemExit("--clock cpu measures one thread: use --threads 1")
        CLOCK[0] = time.thread_time
    data = make_data()
    steps = options.epochs * SAMPLES // BATCH
    raw_times, framework_times = [], []
    with tempfile.TemporaryDirectory() as output_dir:
        raw_loop(data, 1)  # warm-up both paths
        framework_loop(data, 1, options.backend, output_dir, options.quiet, options.profiler)
        for _ in range(options.repeats):
            raw_times.append(raw_loop(data, options.epochs))
            framework_times.append(
                framework_loop(data, options.epochs, options.backend, output_dir, options.quiet, options.profiler)
            )
    raw, framework = statistics.median(raw_times), statistics.median(framework_times)
    paired = statistics.median(f / r for f, r in zip(framework_times, raw_times))
    mode = "progress bar and logging off" if options.quiet else "defaults (progress bar, log every 50 steps)"
    mode += f", profiler={options.profiler}"
    print(f"steps per run: {steps}, repeats: {options.repeats}, torch threads: {options.threads}, {mode}, {options.clock} clock")
    print(f"raw loop:        {raw:.3f} s median ({1e6 * raw / steps:.1f} us/step)")
    print(f"framework ({options.backend}): {framework:.3f} s median ({1e6 * framework / steps:.1f} us/step)")
    print(f"ratio framework/raw: {framework / raw:.3f} (median of medians); {paired:.3f} (median of paired runs)")


if __name__ == "__main__":
    main()
