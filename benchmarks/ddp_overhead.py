"""DDP overhead: the framework's ``ddp`` backend vs a hand-written DDP loop, in one torchrun job.

Both train the same MLP (32-64-64-10, batch 32 per rank, AdamW, in-memory data) for the
same number of steps on the same process group (gloo on CPU, NCCL on CUDA), alternating
framework and raw runs; a run's time is the slowest rank's. The figure is the ratio of
median wall times, framework / raw (target: <= 1.05).

    torchrun --nproc_per_node=2 benchmarks/ddp_overhead.py [--epochs 3] [--repeats 9]

With ``--amp`` (run with plain ``python``, one process) it instead compares ``sp-amp``
with ``sp`` and a hand-written bf16-autocast loop with an fp32 one, on a wider MLP.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overhead import BenchmarkModule, make_net

from framework import Trainer, TrainerArguments

FEATURES, CLASSES = 32, 10


def make_data(samples: int, features: int = FEATURES) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    return TensorDataset(x, (x @ torch.randn(features, CLASSES, generator=generator)).argmax(1))


def device_of_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_ddp_loop(data: TensorDataset, epochs: int, batch_per_rank: int) -> float:
    """The hand-written DDP loop a careful user would write (loss summed on the device,
    averaged over ranks and read back once per epoch)."""
    device = device_of_rank()
    start = time.perf_counter()
    net = make_net().to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_per_rank, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        running, count = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            running += loss.detach()
            count += 1
        dist.all_reduce(running)
        float(running) / (count * dist.get_world_size())
    synchronize(device)
    return time.perf_counter() - start


def framework_loop(
    data: TensorDataset,
    epochs: int,
    global_batch: int,
    backend: str,
    output_dir: str,
    hidden: int = 64,
    log_every_n_steps: int = 50,
) -> float:
    """The framework at its defaults (progress bar off: torchrun output is not a terminal)."""
    device = device_of_rank()
    run_dir = tempfile.mkdtemp(dir=output_dir)  # a fresh directory per run: a run never reuses another's
    start = time.perf_counter()
    args = TrainerArguments(
        epochs=epochs,
        train_batch_size=global_batch,
        backend=backend,
        seed=0,
        output_dir=run_dir,
        disable_tqdm=True,
        log_level="WARNING",
        log_every_n_steps=log_every_n_steps,
        checkpointer_args={"period": 0, "save_at_end": False},
    )
    Trainer(BenchmarkModule(data, hidden), args).train()
    synchronize(device)
    return time.perf_counter() - start


def slowest_rank(seconds: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def alternate(runs: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """Warm every run up once, then ``repeats`` rounds, switching the order every round."""
    names = list(runs)
    for name in names:
        runs[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else reversed(names):
            if dist.is_initialized():
                dist.barrier()
            times[name].append(slowest_rank(runs[name]()))
    return times


def report(times: Dict[str, List[float]], steps: int, baseline: str) -> None:
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
        print(f"  {name:<16} {median:.3f} s median ({spread}), {1e6 * median / steps:.0f} us/step")
    for name, median in medians.items():
        if name != baseline:
            paired = statistics.median(t / b for t, b in zip(times[name], times[baseline]))
            print(f"  ratio {name}/{baseline}: {median / medians[baseline]:.3f} (median of paired ratios {paired:.3f})")


def ddp_benchmark(options: argparse.Namespace) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size < 2:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node=2 benchmarks/ddp_overhead.py")
    device = device_of_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=300),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        torch.set_num_threads(options.threads)
        data = make_data(options.samples_per_rank * world_size)
        steps = options.epochs * options.samples_per_rank // options.batch
        with tempfile.TemporaryDirectory() as output_dir:
            times = alternate(
                {
                    "raw DDP loop": lambda: raw_ddp_loop(data, options.epochs, options.batch),
                    "framework ddp": lambda: framework_loop(data, options.epochs, options.batch * world_size, "ddp", output_dir),
                    "framework, log/epoch": lambda: framework_loop(
                        data, options.epochs, options.batch * world_size, "ddp", output_dir, log_every_n_steps=10**9
                    ),
                },
                options.repeats,
            )
        if dist.get_rank() == 0:
            print(
                f"DDP overhead: {world_size} ranks ({dist.get_backend()}), {steps} steps per run, batch {options.batch} "
                f"per rank, {options.repeats} alternating repeats, {options.threads} torch thread(s) per rank"
            )
            report(times, steps, "raw DDP loop")
    finally:
        dist.destroy_process_group()


def raw_amp_loop(data: TensorDataset, epochs: int, batch: int, hidden: int, amp: bool) -> float:
    start = time.perf_counter()
    net = make_net(data.tensors[0].shape[1], hidden)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def amp_benchmark(options: argparse.Namespace) -> None:
    torch.set_num_threads(options.threads)
    features, hidden, batch, samples = 256, options.amp_hidden, 256, 4096
    data = make_data(samples, features)
    steps = options.epochs * samples // batch
    with tempfile.TemporaryDirectory() as output_dir:
        times = alternate(
            {
                "sp": lambda: framework_loop(data, options.epochs, batch, "sp", output_dir, hidden),
                "sp-amp": lambda: framework_loop(data, options.epochs, batch, "sp-amp", output_dir, hidden),
                "raw fp32": lambda: raw_amp_loop(data, options.epochs, batch, hidden, amp=False),
                "raw bf16": lambda: raw_amp_loop(data, options.epochs, batch, hidden, amp=True),
            },
            options.repeats,
        )
    print(
        f"AMP on CPU (bf16 autocast): MLP {features}-{hidden}-{hidden}-{CLASSES}, batch {batch}, {steps} steps per run, "
        f"{options.repeats} alternating repeats, {options.threads} torch thread(s)"
    )
    report({"sp": times["sp"], "sp-amp": times["sp-amp"]}, steps, "sp")
    report({"raw fp32": times["raw fp32"], "raw bf16": times["raw bf16"]}, steps, "raw fp32")
    report({"raw bf16": times["raw bf16"], "sp-amp": times["sp-amp"]}, steps, "raw bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--samples-per-rank", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32, help="batch per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--amp", action="store_true", help="compare sp-amp with sp (one process) instead")
    parser.add_argument("--amp-hidden", type=int, default=512)
    options = parser.parse_args()
    if options.amp:
        amp_benchmark(options)
    else:
        ddp_benchmark(options)


if __name__ == "__main__":
    main()
