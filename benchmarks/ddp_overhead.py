"""DDP overhead: the framework's ``ddp`` backend vs a hand-written DDP loop.

Both train the same MLP (32-64-64-10, batch 32 per rank, AdamW, in-memory data) with gloo on
CPU (NCCL on CUDA); a run's time is the slowest rank's. Target: framework / raw <= 1.05.

The whole run, as a user pays for it (run with plain ``python``): every run is a fresh
``torchrun --standalone --nproc_per_node=N`` job of one runner (``raw``: the hand-written loop,
which joins and leaves the process group itself; ``ddp``: the framework at its defaults, which
joins it in ``Trainer``; ``ddp-quiet``: losses read back only at epoch ends), alternating
runners within a round. Over the run lengths given it fits, per runner, the seconds per step
(slope of the training call) and the fixed cost (intercept of the whole job: torchrun, imports,
rendezvous, set-up), each as a ratio to the raw loop's:

    python benchmarks/ddp_overhead.py [--nproc 2] [--repeats 5] [--epochs 1 2 4] [--device auto|cpu|cuda]

The steady loop only, both runners alternating inside one torchrun job on one process group
(warm imports and group; the ratio of median training times):

    torchrun --nproc_per_node=2 benchmarks/ddp_overhead.py [--epochs 3] [--repeats 9]

With ``--amp`` (run with plain ``python``, one process) it instead compares ``sp-amp``
with ``sp`` and a hand-written bf16-autocast loop with an fp32 one, on a wider MLP.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fresh_process import fit_line, json_objects, run_process_output

from overhead import EPOCH_STARTS, TRAINING_END, BenchmarkModule, make_net

from framework import Trainer, TrainerArguments

FEATURES, CLASSES = 32, 10


def make_data(samples: int, features: int = FEATURES) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    return TensorDataset(x, (x @ torch.randn(features, CLASSES, generator=generator)).argmax(1))


DEVICE = ["auto"]  # --device: "auto" (CUDA when available), "cpu" or "cuda"
FRESH_RUNNERS = ("raw", "ddp", "ddp-quiet")


def device_of_rank() -> torch.device:
    if DEVICE[0] == "cuda" or (DEVICE[0] == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_ddp_loop(data: TensorDataset, epochs: int, batch_per_rank: int, hidden: int = 64) -> float:
    """The hand-written DDP loop a careful user would write (loss summed on the device,
    averaged over ranks and read back once per epoch). Without a process group (one rank) it
    is the plain loop on a one-replica ``DistributedSampler``, as the framework's ``ddp`` is."""
    device = device_of_rank()
    start = time.perf_counter()
    net = make_net(data.tensors[0].shape[1], hidden).to(device)
    distributed = dist.is_initialized()
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_per_rank, sampler=sampler)
    epoch_starts = []
    for epoch in range(epochs):
        epoch_starts.append(time.perf_counter())
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
        if distributed:
            dist.all_reduce(running)
        float(running) / (count * world_size)
    synchronize(device)
    end = time.perf_counter()
    STEADY_SECONDS[:] = [end - epoch_starts[1] if epochs > 1 else 0.0]
    return end - start


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
        plot_metrics=False,  # drawn once, after the last step: a fixed cost of rank 0 (docs/benchmarks.md)
        log_level="WARNING",
        log_every_n_steps=log_every_n_steps,
        checkpointer_args={"period": 0, "save_at_end": False},
        use_gpu=device.type == "cuda",
    )
    EPOCH_STARTS.clear()
    TRAINING_END.clear()
    Trainer(BenchmarkModule(data, hidden), args).train()
    synchronize(device)
    STEADY_SECONDS[:] = [TRAINING_END[0] - EPOCH_STARTS[1] if epochs > 1 else 0.0]
    return time.perf_counter() - start


STEADY_SECONDS: List[float] = [0.0]  # the last run's seconds from its second epoch's start to its last epoch's end


def slowest_rank(seconds: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def alternate(
    runs: Dict[str, Callable[[], float]], repeats: int, steady: Optional[Dict[str, List[float]]] = None
) -> Dict[str, List[float]]:
    """Warm every run up once, then ``repeats`` rounds, switching the order every round; with
    ``steady``, also collect each run's :data:`STEADY_SECONDS` (the slowest rank's) there."""
    names = list(runs)
    for name in names:
        runs[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else reversed(names):
            if dist.is_initialized():
                dist.barrier()
            times[name].append(slowest_rank(runs[name]()))
            if steady is not None:
                steady.setdefault(name, []).append(slowest_rank(STEADY_SECONDS[0]))
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
        raise SystemExit("run under torchrun with 2+ ranks: torchrun --nproc_per_node=2 benchmarks/ddp_overhead.py")
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
        steady: Dict[str, List[float]] = {}
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
                steady,
            )
        if dist.get_rank() == 0:
            print(
                f"DDP overhead: {world_size} ranks ({dist.get_backend()}), {steps} steps per run, batch {options.batch} "
                f"per rank, {options.repeats} alternating repeats, {options.threads} torch thread(s) per rank"
            )
            report(times, steps, "raw DDP loop")
            if options.epochs > 1:
                print(f"steady (second epoch's start to the last epoch's end, {steps - steps // options.epochs} steps):")
                report(steady, steps - steps // options.epochs, "raw DDP loop")
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


# -- fresh processes: one torchrun job per run ------------------------------------------------
def fresh_child(options: argparse.Namespace) -> None:
    """One run of one runner in this torchrun job; every rank prints its training seconds."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    torch.set_num_threads(options.threads)
    data = make_data(options.samples_per_rank * world_size)
    epochs = options.epochs[0]
    if options.child == "raw":
        device = device_of_rank()
        start = time.perf_counter()  # joining the group is inside, as it is inside the framework's Trainer
        if world_size > 1:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=300),
                device_id=device if device.type == "cuda" else None,
            )
        joined = time.perf_counter() - start
        seconds = joined + raw_ddp_loop(data, epochs, options.batch, options.hidden)
        if world_size > 1:
            dist.barrier()
            dist.destroy_process_group()
    else:
        log_every = 50 if options.child == "ddp" else 10**9
        with tempfile.TemporaryDirectory() as output_dir:
            seconds = framework_loop(data, epochs, options.batch * world_size, "ddp", output_dir, options.hidden, log_every)
    sys.stdout.write(json.dumps({"rank": rank, "train_seconds": seconds}) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()


def torchrun_job(nproc: int, runner: str, epochs: int, options: argparse.Namespace) -> Tuple[float, float]:
    """Wall seconds of one fresh ``torchrun`` job of ``runner``, and its slowest rank's training seconds."""
    arguments = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", os.path.abspath(__file__)]
    arguments += ["--child", runner, "--epochs", str(epochs), "--samples-per-rank", str(options.samples_per_rank)]
    arguments += ["--batch", str(options.batch), "--threads", str(options.threads), "--hidden", str(options.hidden)]
    arguments += ["--device", options.device]
    seconds, output = run_process_output(arguments)
    ranks = json_objects(output)
    if len(ranks) != nproc:
        raise SystemExit(f"{runner}: expected {nproc} ranks to report, got {len(ranks)}:\n{output[-2000:]}")
    return seconds, max(rank["train_seconds"] for rank in ranks)


def fresh_runs(
    nproc: int, runners: Sequence[str], epochs_list: Sequence[int], repeats: int, options: argparse.Namespace
) -> Dict[str, Dict[str, float]]:
    """Alternate fresh torchrun jobs; per runner: slope (s/step of the training call), intercept
    (s, whole job), whole job and training call of the longest run (medians)."""
    process: Dict[Tuple[str, int], List[float]] = {}
    training: Dict[Tuple[str, int], List[float]] = {}
    for round_index in range(repeats):
        for epochs in epochs_list:
            for runner in runners if round_index % 2 == 0 else list(reversed(runners)):
                seconds, train = torchrun_job(nproc, runner, epochs, options)
                process.setdefault((runner, epochs), []).append(seconds)
                training.setdefault((runner, epochs), []).append(train)
    steps_per_epoch = options.samples_per_rank // options.batch
    steps = [steps_per_epoch * epochs for epochs in epochs_list]
    longest = max(epochs_list)
    figures = {}
    for runner in runners:
        slope, _ = fit_line(steps, [statistics.median(training[(runner, e)]) for e in epochs_list])
        _, intercept = fit_line(steps, [statistics.median(process[(runner, e)]) for e in epochs_list])
        figures[runner] = {
            "slope": slope,
            "intercept": intercept,
            "whole": statistics.median(process[(runner, longest)]),
            "train": statistics.median(training[(runner, longest)]),
        }
    return figures


def fresh_benchmark(options: argparse.Namespace) -> None:
    if len(set(options.epochs)) < 2:
        raise SystemExit(f"--epochs needs at least two different run lengths to fit a slope, got {options.epochs}")
    figures = fresh_runs(options.nproc, options.runners, options.epochs, options.repeats, options)
    steps = [options.samples_per_rank // options.batch * epochs for epochs in options.epochs]
    print(
        f"DDP, fresh torchrun jobs alternating: {options.nproc} ranks, {options.repeats} rounds, steps per run {steps}, "
        f"batch {options.batch} per rank, {options.threads} torch thread(s) per rank; medians"
    )
    print("| runner | us/step (slope) | / raw | fixed s (intercept) | / raw | whole job s | / raw | train() s | / raw |")
    print("|---|---|---|---|---|---|---|---|---|")
    reference = figures[options.runners[0]]
    for runner, values in figures.items():
        ratios = {key: value / reference[key] if reference[key] > 0 else float("nan") for key, value in values.items()}
        print(
            f"| {runner} | {1e6 * values['slope']:.1f} | {ratios['slope']:.3f} | {values['intercept']:.2f} | "
            f"{ratios['intercept']:.3f} | {values['whole']:.2f} | {ratios['whole']:.3f} | {values['train']:.3f} | "
            f"{ratios['train']:.3f} |"
        )
    print(f"(whole job and train(): the {max(steps)}-step run; ratios to {options.runners[0]}; target ddp / raw <= 1.05)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, nargs="+", default=None, help="fresh jobs: run lengths (default 1 2 4)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 fresh rounds, 9 in one job")
    parser.add_argument("--nproc", type=int, default=2, help="fresh jobs: ranks per torchrun job")
    parser.add_argument("--runners", nargs="+", default=["raw", "ddp"], choices=FRESH_RUNNERS, help="fresh jobs")
    parser.add_argument("--hidden", type=int, default=64, help="MLP width")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--child", choices=FRESH_RUNNERS, help=argparse.SUPPRESS)
    parser.add_argument("--samples-per-rank", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32, help="batch per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--amp", action="store_true", help="compare sp-amp with sp (one process) instead")
    parser.add_argument("--amp-hidden", type=int, default=512)
    options = parser.parse_args()
    DEVICE[0] = options.device
    in_job = "WORLD_SIZE" in os.environ
    if options.child:
        options.epochs = options.epochs or [1]
        fresh_child(options)
        return
    options.epochs = options.epochs or ([3] if options.amp or in_job else [1, 2, 4])
    if options.amp or in_job:
        if len(options.epochs) != 1:
            raise SystemExit("--amp and a run inside torchrun take one --epochs value")
        options.epochs = options.epochs[0]
        options.repeats = options.repeats or 9
        if options.amp:
            amp_benchmark(options)
        else:
            ddp_benchmark(options)
    else:
        options.repeats = options.repeats or 5
        fresh_benchmark(options)


if __name__ == "__main__":
    main()
