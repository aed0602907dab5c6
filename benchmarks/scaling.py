"""Scaling of the framework's cost, whole processes alternating with the hand-written equivalent.

One command, four axes, each printed as a markdown table (paste them into docs/benchmarks.md,
"Scaling"). Every measurement is a fresh process (or a fresh ``torchrun`` job), alternating
framework and raw runs within a round, the order reversed every other round; figures are
medians over ``--repeats`` rounds.

- ``length``: the tiny MLP of ``overhead.py`` (``fresh_process.py``'s children: 256 steps per
  epoch, 1 torch thread) for 256/512/1024/2048 steps: raw loop, framework with extras off
  (``quiet``) and at its defaults. Per run length: the training call, its ratio to raw, us per
  step and the marginal us per step from the previous length (flat = no growth per step); then
  the fitted slope (us/step) and fixed cost (s) per runner.
- ``width``: the same MLP at hidden widths 32/256/1024 (features-W-W-10): the per-step slope
  over two run lengths, framework / raw.
- ``world``: ``ddp_overhead.py``'s fresh jobs at 1, 2 and 4 ranks (``torchrun --standalone``,
  gloo on CPU, NCCL with ``--device cuda``): framework ``ddp`` at its defaults vs the raw DDP
  loop; slope, fixed cost and the whole job, ratios to raw. One rank: no process group, for
  both (the framework's ``ddp`` does not make one for a single rank).
- ``checkpoint``: a stack of 4 ``Linear(W, W)`` layers sized to 1e5/1e6/1e7/5e7 parameters,
  SGD with momentum (a checkpoint of ~3x the parameter bytes): how long one save stalls the
  training loop. ``raw``: ``torch.save`` of the model and optimizer state to a file, without
  and with ``os.fsync`` (the framework's saves are durable: fsync on); ``sync``:
  ``Trainer.save_checkpoint`` with the default checkpointer; ``async``: with ``async_save=True``
  (the stall is the copy to CPU buffers; the first async save also allocates them and is
  reported apart; the background write is waited for before the next save, outside the stall).

    python benchmarks/scaling.py [--axes length width world checkpoint] [--repeats 5] [--quick] [--device auto|cpu|cuda]

``--quick`` is a smoke run (one round, fewer points, smaller jobs: a few minutes on 2 CPU
cores); its figures are not to be published. ``--device`` applies to ``world`` and
``checkpoint`` (the MLP axes run on CPU, as ``fresh_process.py`` does).
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from fresh_process import fit_line, run_process  # noqa: E402

AXES = ("length", "width", "world", "checkpoint")
STEPS_PER_EPOCH = 256  # fresh_process.py: 8192 samples, batch 32
FULL = {
    "length_epochs": [1, 2, 4, 8],
    "length_runners": ["raw", "quiet", "defaults"],
    "widths": [32, 256, 1024],
    "width_epochs": [1, 4],
    "width_runners": ["raw", "quiet", "defaults"],
    "world_sizes": [1, 2, 4],
    "world_epochs": [1, 4],
    "samples_per_rank": 4096,
    "parameters": [1e5, 1e6, 1e7, 5e7],
    "saves": 3,
}
QUICK = {
    "length_epochs": [1, 2],
    "length_runners": ["raw", "quiet", "defaults"],
    "widths": [32, 256],
    "width_epochs": [1, 2],
    "width_runners": ["raw", "quiet"],
    "world_sizes": [1, 2],
    "world_epochs": [1, 2],
    "samples_per_rank": 1024,
    "parameters": [1e5, 1e6],
    "saves": 2,
}
CHECKPOINT_MODES = ("raw", "sync", "async")
Job = Tuple[Any, str]  # (point on the axis, runner)


def alternate(
    points: Sequence[Any], runners: Sequence[str], repeats: int, run: Callable[[Any, str], Any]
) -> Dict[Job, List[Any]]:
    """``repeats`` rounds; in each, every point and, per point, every runner once (order reversed
    every other round). Returns each (point, runner)'s results."""
    results: Dict[Job, List[Any]] = {}
    for round_index in range(repeats):
        for point in points:
            for runner in runners if round_index % 2 == 0 else list(reversed(runners)):
                results.setdefault((point, runner), []).append(run(point, runner))
    return results


def mlp_run(epochs: int, runner: str, hidden: int = 64) -> Tuple[float, float]:
    """One fresh ``fresh_process.py`` child: (process seconds, training-call seconds)."""
    arguments = [os.path.join(HERE, "fresh_process.py"), "--child", runner, "--epochs", str(epochs), "--hidden", str(hidden)]
    seconds, line = run_process(arguments)
    return seconds, json.loads(line)["train_seconds"]


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.3f}" if reference > 0 else "n/a"


# -- (a) run length ----------------------------------------------------------------------------
def length_axis(settings: Dict[str, Any], repeats: int) -> List[str]:
    epochs_list, runners = settings["length_epochs"], settings["length_runners"]
    results = alternate(epochs_list, runners, repeats, lambda epochs, runner: mlp_run(epochs, runner))
    process = {key: statistics.median(value[0] for value in values) for key, values in results.items()}
    train = {key: statistics.median(value[1] for value in values) for key, values in results.items()}
    lines = [
        f"### Run length (MLP 32-64-64-10, batch 32, 1 thread; {repeats} rounds, medians)",
        "",
        "| steps | runner | whole process s | train() s | train() / raw | us/step | marginal us/step | marginal / raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, epochs in enumerate(epochs_list):
        steps = STEPS_PER_EPOCH * epochs
        for runner in runners:
            seconds = train[(epochs, runner)]
            marginal, marginal_ratio = "", ""
            if index:
                previous = epochs_list[index - 1]
                added = STEPS_PER_EPOCH * (epochs - previous)
                value = (seconds - train[(previous, runner)]) / added
                raw_value = (train[(epochs, runners[0])] - train[(previous, runners[0])]) / added
                marginal, marginal_ratio = f"{1e6 * value:.1f}", ratio(value, raw_value)
            lines.append(
                f"| {steps} | {runner} | {process[(epochs, runner)]:.2f} | {seconds:.3f} | "
                f"{ratio(seconds, train[(epochs, runners[0])])} | {1e6 * seconds / steps:.1f} | {marginal} | {marginal_ratio} |"
            )
    lines += fit_table(epochs_list, runners, process, train)
    return lines


def fit_table(points: Sequence[int], runners: Sequence[str], process: Dict[Job, float], train: Dict[Job, float]) -> List[str]:
    """Per runner: slope of the training call (us/step) and intercept of the whole process (s), ratios to the first runner."""
    steps = [STEPS_PER_EPOCH * epochs for epochs in points]
    fits = {}
    for runner in runners:
        slope, _ = fit_line(steps, [train[(epochs, runner)] for epochs in points])
        _, intercept = fit_line(steps, [process[(epochs, runner)] for epochs in points])
        fits[runner] = (slope, intercept)
    lines = ["", "| runner | us/step (slope) | / raw | fixed s (intercept) | / raw |", "|---|---|---|---|---|"]
    reference = fits[runners[0]]
    for runner, (slope, intercept) in fits.items():
        slope_ratio, intercept_ratio = ratio(slope, reference[0]), ratio(intercept, reference[1])
        lines.append(f"| {runner} | {1e6 * slope:.1f} | {slope_ratio} | {intercept:.2f} | {intercept_ratio} |")
    return lines


# -- (b) model size ----------------------------------------------------------------------------
def width_axis(settings: Dict[str, Any], repeats: int) -> List[str]:
    widths, epochs_list, runners = settings["widths"], settings["width_epochs"], settings["width_runners"]
    points = [(width, epochs) for width in widths for epochs in epochs_list]
    results = alternate(points, runners, repeats, lambda point, runner: mlp_run(point[1], runner, point[0]))
    train = {key: statistics.median(value[1] for value in values) for key, values in results.items()}
    steps = [STEPS_PER_EPOCH * epochs for epochs in epochs_list]
    header = " | ".join(
        f"{runner} us/step" + ("" if runner == runners[0] else f" | {runner} / {runners[0]}") for runner in runners
    )
    lines = [
        f"### Model size (MLP 32-W-W-10, batch 32, 1 thread; slope of train() over {steps} steps; {repeats} rounds, medians)",
        "",
        f"| width W | parameters | {header} |",
        "|---|---|" + "---|" * (2 * len(runners) - 1),
    ]
    for width in widths:
        slopes = {runner: fit_line(steps, [train[((width, epochs), runner)] for epochs in epochs_list])[0] for runner in runners}
        cells = []
        for runner in runners:
            cells.append(f"{1e6 * slopes[runner]:.1f}")
            if runner != runners[0]:
                cells.append(ratio(slopes[runner], slopes[runners[0]]))
        parameters = 32 * width + width + width * width + width + width * 10 + 10
        lines.append(f"| {width} | {parameters:,} | " + " | ".join(cells) + " |")
    return lines


# -- (c) world size ----------------------------------------------------------------------------
def world_axis(settings: Dict[str, Any], repeats: int, device: str) -> List[str]:
    import ddp_overhead

    ddp_overhead.DEVICE[0] = device
    options = argparse.Namespace(samples_per_rank=settings["samples_per_rank"], batch=32, threads=1, hidden=64, device=device)
    epochs_list, runners = settings["world_epochs"], ["raw", "ddp"]
    steps = [options.samples_per_rank // options.batch * epochs for epochs in epochs_list]
    lines = [
        f"### World size (torchrun --standalone, {device} device, gloo on CPU; MLP 32-64-64-10, batch 32 per rank, "
        f"1 thread per rank, {options.samples_per_rank} samples per rank; steps per run {steps}; {repeats} rounds, medians)",
        "",
        "| ranks | raw us/step | ddp us/step | / raw | raw fixed s | ddp fixed s | / raw "
        "| raw whole job s | ddp whole job s | / raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for nproc in settings["world_sizes"]:
        figures = ddp_overhead.fresh_runs(nproc, runners, epochs_list, repeats, options)
        raw, ddp = figures["raw"], figures["ddp"]
        lines.append(
            f"| {nproc} | {1e6 * raw['slope']:.1f} | {1e6 * ddp['slope']:.1f} | {ratio(ddp['slope'], raw['slope'])} | "
            f"{raw['intercept']:.2f} | {ddp['intercept']:.2f} | {ratio(ddp['intercept'], raw['intercept'])} | "
            f"{raw['whole']:.2f} | {ddp['whole']:.2f} | {ratio(ddp['whole'], raw['whole'])} |"
        )
    lines.append(f"(whole job: the {max(steps)}-step run)")
    return lines


# -- (d) checkpoint ----------------------------------------------------------------------------
def stack_width(parameters: float, layers: int = 4) -> int:
    """Width W of ``layers`` x Linear(W, W) (with bias) closest to ``parameters``."""
    return max(1, round((-1 + math.sqrt(1 + 4 * parameters / layers)) / 2))


def make_stack(width: int, layers: int = 4):
    import torch

    torch.manual_seed(0)
    blocks: List[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


def checkpoint_child(mode: str, parameters: float, saves: int, device_name: str) -> Dict[str, Any]:
    """Train the stack and save ``saves`` times; return the stall of every save (and writes)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    use_gpu = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_gpu else "cpu")
    width = stack_width(parameters)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, width, generator=generator), torch.randn(16, width, generator=generator))
    warmup, gap = 2, 2  # optimizer steps before the first save, and between saves
    directory = tempfile.mkdtemp(prefix="scaling-checkpoint-")
    result: Dict[str, Any] = {"width": width}
    if mode == "raw":
        net = make_stack(width).to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
        stalls: Dict[str, List[float]] = {"plain": [], "fsync": []}
        loader = DataLoader(data, batch_size=4, shuffle=True)
        step = 0
        while len(stalls["fsync"]) < saves:
            for x, y in loader:
                loss = F.mse_loss(net(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step < warmup or (step - warmup) % gap:
                    continue
                for kind in ("plain", "fsync"):
                    path = os.path.join(directory, f"{kind}-{step}.pt")
                    started = time.perf_counter()
                    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
                    if kind == "fsync":
                        with open(path, "rb") as handle:
                            os.fsync(handle.fileno())
                    stalls[kind].append(time.perf_counter() - started)
                    result["bytes"] = os.path.getsize(path)
                    os.remove(path)
                if len(stalls["fsync"]) >= saves:
                    break
        result["parameters"] = sum(p.numel() for p in net.parameters())
        result.update(stall=stalls["plain"], stall_fsync=stalls["fsync"])
        return result

    from checkpoint import TimedCheckpointer, TimedTrainer

    from framework import ModuleInterface, TrainerArguments
    from framework.callbacks import Callback, StopTraining
    from framework.checkpoint import DefaultCheckpointerArguments

    class Stack(ModuleInterface):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_stack(width)

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)], []

        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(data, batch_size=batch_size, sampler=sampler(data))

        def train_step(self, global_step, batch, device):
            x, y = batch
            return F.mse_loss(self.net(x), y)

    class Saver(Callback):
        def setup(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_end_optimizer_step(self, global_step: int) -> None:
            if global_step < warmup or (global_step - warmup) % gap:
                return
            checkpointer.wait()  # the previous background write is done (saves minutes apart), outside the stall
            if len(self.trainer.save_durations) >= saves:
                raise StopTraining("benchmark done", save_checkpoint=False)
            self.trainer.save_checkpoint()

    arguments = DefaultCheckpointerArguments(save_dir=directory, period=0, save_at_end=False, async_save=mode == "async")
    args = TrainerArguments(
        epochs=10**6,
        train_batch_size=4,
        disable_tqdm=True,
        log_level="WARNING",
        log_every_n_steps=10**6,
        val_every_n_epochs=0,
        output_dir=os.path.join(directory, "out"),
        checkpointer_args=arguments,
        use_gpu=use_gpu,
    )
    checkpointer = TimedCheckpointer(arguments)
    module = Stack()
    trainer = TimedTrainer(module, args, checkpointer=checkpointer, callbacks=[Saver()])
    trainer.train()
    trainer.close()
    names = sorted(name for name in os.listdir(directory) if name.startswith("checkpoint-"))
    result["bytes"] = os.path.getsize(os.path.join(directory, names[-1])) if names else 0
    result["parameters"] = sum(p.numel() for p in module.parameters())
    result.update(stall=trainer.save_durations, write=[end - start for start, end in checkpointer.writes])
    return result


def checkpoint_run(parameters: float, mode: str, saves: int, device: str) -> Dict[str, Any]:
    arguments = [__file__, "--child-checkpoint", mode, "--parameters", f"{parameters:g}", "--saves", str(saves)]
    return json.loads(run_process([*arguments, "--device", device])[1])


def checkpoint_axis(settings: Dict[str, Any], repeats: int, device: str) -> List[str]:
    sizes, saves = settings["parameters"], settings["saves"]
    results = alternate(sizes, CHECKPOINT_MODES, repeats, lambda size, mode: checkpoint_run(size, mode, saves, device))

    def median_of(size: float, mode: str, field: str, first: bool = False) -> float:
        values = [run[field][0] if first else statistics.median(run[field][1:] or run[field]) for run in results[(size, mode)]]
        return statistics.median(values)

    lines = [
        f"### Checkpoint stall vs parameter count (4 x Linear(W, W), SGD with momentum, {device} device; "
        f"{saves} saves per process, {repeats} rounds, medians; later saves, the first apart)",
        "",
        "| parameters | checkpoint MB | raw torch.save s | raw + fsync s | sync stall s | sync / raw + fsync | "
        "async stall s | async / sync | async first save s | async background write s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        sample = results[(size, "sync")][0]
        raw, raw_fsync = median_of(size, "raw", "stall"), median_of(size, "raw", "stall_fsync")
        sync, asynchronous = median_of(size, "sync", "stall"), median_of(size, "async", "stall")
        lines.append(
            f"| {sample['parameters']:,} | {sample['bytes'] / 1e6:.1f} | {raw:.4f} | {raw_fsync:.4f} | {sync:.4f} | "
            f"{ratio(sync, raw_fsync)} | {asynchronous:.4f} | {ratio(asynchronous, sync)} | "
            f"{median_of(size, 'async', 'stall', first=True):.4f} | {median_of(size, 'async', 'write'):.4f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--axes", nargs="+", choices=AXES, default=list(AXES))
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 5; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one round, fewer points, small jobs")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="world and checkpoint axes")
    parser.add_argument("--child-checkpoint", choices=CHECKPOINT_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--parameters", type=float, default=1e6, help=argparse.SUPPRESS)
    parser.add_argument("--saves", type=int, default=3, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child_checkpoint:
        print(json.dumps(checkpoint_child(options.child_checkpoint, options.parameters, options.saves, options.device)))
        return
    settings = QUICK if options.quick else FULL
    repeats = options.repeats or (1 if options.quick else 5)
    device = options.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    started = time.perf_counter()
    print(f"## Scaling{' (--quick smoke run: not figures to publish)' if options.quick else ''}")
    print(f"\n{os.cpu_count()} CPU cores, load average {load:.1f} at the start, {sys.version.split()[0]}")
    axes = {
        "length": lambda: length_axis(settings, repeats),
        "width": lambda: width_axis(settings, repeats),
        "world": lambda: world_axis(settings, repeats, device),
        "checkpoint": lambda: checkpoint_axis(settings, repeats, device),
    }
    for axis in options.axes:
        axis_start = time.perf_counter()
        lines = axes[axis]()
        print("\n" + "\n".join(lines))
        print(f"\n({axis}: {time.perf_counter() - axis_start:.0f} s)", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average {load:.1f} at the end")


if __name__ == "__main__":
    main()
