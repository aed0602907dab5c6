"""Pipeline parallelism: the framework's pipeline step against a hand-written ``torch.distributed.pipelining``
loop with the same schedule, and the bubble and activation memory of every schedule torch offers.

The model is the Llama-style example of docs/pipeline-parallel.md (``examples/pipeline_parallel.py``:
embeddings, an ``nn.ModuleDict`` of blocks, norm, head), scaled to width 128, 8 blocks, SwiGLU 384,
sequences of 64 tokens, batches of 16, AdamW. Each process count is one ``torchrun --standalone`` job
(gloo on CPU, 1 thread per rank; NCCL with ``--device cuda``) in which every run below takes its turn:

- ratio: the framework's path (``PipelineRunner``: the stage cut by ``default_stages`` / ``keep_stage``,
  each micro-batch's loss divided by their number) against the hand-written loop (the stage cut by hand,
  torch's schedule class with its own gradient scaling), both built side by side and taking steps in
  turn (which goes first alternates), for GPipe and 1F1B at ``--micro-batches``; a round's figure per
  runner is the slowest rank's median step (schedule + AdamW, timed alone: no compute clock, no
  activation meter) over ``--steps`` steps after a warm-up step, and the CPU seconds of a step summed over
  the ranks; ``--rounds`` rounds build both afresh; the ratio is of the medians over rounds. With
  ``--trainer`` the framework's side is ``Trainer`` (``backend="fsdp"``, ``pipeline_parallel_size``,
  ``pipeline_schedule``, the micro-batch from ``gpu_batch_size_limit``; whole runs alternate, as the
  Trainer owns its loop), which needs the pipeline contract of issue 52 in ``TrainerArguments``.
- bubble and memory: for each schedule (GPipe, 1F1B, and the interleaved and V ones, which the framework
  refuses: measured with the hand-written loop) and 2, 4, 8 micro-batches, ``1 - compute / wall`` of the
  schedule's step averaged over ranks (compute: the stages' forward/backward methods and the loss, timed
  per call; see ``pipeline_runs.py``) beside the textbook ``(p - 1) / (v m + p - 1)``, and each rank's
  peak bytes of activations held for backward.

    python benchmarks/pipeline.py [--nproc 2 4] [--rounds 3] [--steps 8] [--micro-batches 4] [--trainer]
    python benchmarks/pipeline.py --nproc 2 --schedules GPipe 1F1B --micro-batch-counts 4   # a quicker look

On a CPU the processes share cores: with more processes than free cores each rank's compute is slowed by
the others' and a waiting rank lends its core, so CPU bubbles are not those of dedicated devices: compare
schedules within one table, and read the textbook column beside them.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=256, dim=128, n_layers=8, n_heads=4, hidden_dim=384, seq_len=64)
BATCH = 16
RATIO_SCHEDULES = ["GPipe", "1F1B"]
ALL_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
CONTRACT = ("pipeline_parallel_size", "pipeline_schedule")


def trainer_contract_missing(arguments: Optional[type] = None) -> List[str]:
    """The pipeline fields of issue 52 that ``arguments`` (default: this checkout's ``TrainerArguments``)
    lacks ([] once it has them)."""
    if arguments is None:
        sys.path[:0] = [ROOT]
        from framework import TrainerArguments as arguments
    names = {field.name for field in dataclasses.fields(arguments)}
    return [name for name in CONTRACT if name not in names]


def check_trainer_contract(arguments: Optional[type] = None) -> None:
    """Refuse ``--trainer`` at once, naming what is missing, where the framework has no pipeline yet."""
    missing = trainer_contract_missing(arguments)
    if missing:
        raise SystemExit(
            f"--trainer times the Trainer's pipeline, but this checkout's TrainerArguments has no {missing} (the "
            "pipeline contract of issue 52: pipeline_parallel_size, pipeline_schedule, ModuleInterface.pipeline_inputs "
            "and pipeline_loss). Run without --trainer to time the framework's PipelineRunner."
        )


def _example() -> Any:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    import pipeline_parallel

    return pipeline_parallel


def workload(steps: int) -> Any:
    """The example's Llama at the benchmark's size, ``steps + 1`` batches of its sequences (one warm-up)."""
    import torch
    from pipeline_runs import Workload

    example = _example()
    config = example.LlamaArguments(**MODEL, samples=BATCH * (steps + 1))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return example.PipelineLlama(config)

    tokens = example.rule_sequences(BATCH * (steps + 1), MODEL["seq_len"] + 1, MODEL["vocab_size"])
    module = model()
    batches = [module.pipeline_inputs((tokens[i * BATCH : (i + 1) * BATCH],)) for i in range(steps + 1)]
    return Workload(model=model, blocks="layers", loss=module.pipeline_loss, batches=batches, warmup=1)


def trainer_run(steps: int, schedule: str, micro_batches: int, ranks: int, device: Any) -> Dict[str, Any]:
    """The framework's side through ``Trainer`` (issue 52's contract): the slowest rank's median step."""
    import tempfile
    import time

    import torch
    import torch.distributed as dist

    from framework import Trainer, TrainerArguments
    from framework.callbacks import Callback

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: List[float] = []
            self.cpu: List[float] = []
            self.last, self.last_cpu = 0.0, 0.0

        def on_begin_train(self, global_step: int) -> None:
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_end_optimizer_step(self, global_step: int) -> None:
            now, now_cpu = time.perf_counter(), time.process_time()
            self.times.append(now - self.last)
            self.cpu.append(now_cpu - self.last_cpu)
            self.last, self.last_cpu = now, now_cpu

    example, clock = _example(), StepClock()
    torch.manual_seed(0)
    module = example.PipelineLlama(example.LlamaArguments(**MODEL, samples=BATCH * (steps + 1)))
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainerArguments(
            epochs=1,
            max_steps=steps + 1,
            train_batch_size=BATCH,
            gpu_batch_size_limit=BATCH // micro_batches,
            backend="fsdp",
            use_gpu=device.type == "cuda",
            val_every_n_epochs=0,
            sanity_val_steps=0,
            log_every_n_steps=10**6,
            disable_tqdm=True,
            model_summary=False,
            log_level="WARNING",
            loggers=[],
            output_dir=output_dir,
            checkpointer_args={"period": 0, "save_at_end": False},
            **{"pipeline_parallel_size": ranks, "pipeline_schedule": schedule},
        )
        Trainer(module, args, callbacks=[clock]).train()
    median = torch.tensor(statistics.median(clock.times[1:] or clock.times))
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    cpu = torch.tensor(statistics.median(clock.cpu[1:] or clock.cpu))
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return {"step": float(median), "cpu": float(cpu)}


def child(options: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from pipeline_runs import (
        alternating,
        hand_written_run,
        prepare_framework,
        prepare_hand_written,
        stages_per_rank,
    )

    torch.set_num_threads(1)
    cuda = options.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    group, ranks = dist.group.WORLD, dist.get_world_size()
    work = workload(options.steps)
    timing = dataclasses.replace(work, measure=False)  # the ratio: steps timed alone, no meters' hooks
    results: Dict[str, Any] = {"ranks": ranks, "ratio": {}, "table": []}
    runs: Dict[str, Any] = {}
    for schedule in RATIO_SCHEDULES:
        rounds: Dict[str, List[float]] = {"framework": [], "raw": [], "framework_cpu": [], "raw_cpu": []}
        for round_ in range(options.rounds):
            if options.trainer:  # the Trainer owns its loop: whole runs alternate
                for runner in ["framework", "raw"] if round_ % 2 == 0 else ["raw", "framework"]:
                    if runner == "raw":
                        figure = hand_written_run(timing, schedule, options.micro_batches, device, group)
                    else:
                        figure = trainer_run(options.steps, schedule, options.micro_batches, ranks, device)
                    rounds[runner].append(figure["step"])
                    rounds[f"{runner}_cpu"].append(figure["cpu"])
                continue
            runs = {
                "framework": prepare_framework(timing, schedule, options.micro_batches, device, group),
                "raw": prepare_hand_written(timing, schedule, options.micro_batches, device, group),
            }
            for runner, summary in alternating(runs, timing, options.steps, group).items():
                rounds[runner].append(summary["step"])
                rounds[f"{runner}_cpu"].append(summary["cpu"])
        results["ratio"][schedule] = rounds
    for schedule in options.schedules:
        for micro_batches in options.micro_batch_counts:
            row: Dict[str, Any] = {"schedule": schedule, "micro_batches": micro_batches}
            try:
                runs = {"raw": prepare_hand_written(work, schedule, micro_batches, device, group)}
            except ValueError as refusal:  # torch's own checks, the same on every rank
                row["raw"] = {"refused": str(refusal).split("\n")[0]}
                results["table"].append(row)
                continue
            if stages_per_rank(schedule) == 1:
                runs["framework"] = prepare_framework(work, schedule, micro_batches, device, group)
            row.update(alternating(runs, work, options.steps, group))
            results["table"].append(row)
    rank = dist.get_rank()
    del runs  # the stages and their pending sends go before the group does
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def launch(options: argparse.Namespace, nproc: int) -> Dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [os.path.abspath(__file__), "--child", "--steps", str(options.steps), "--rounds", str(options.rounds)]
    command += ["--micro-batches", str(options.micro_batches), "--device", options.device, "--schedules", *options.schedules]
    command += ["--micro-batch-counts", *map(str, options.micro_batch_counts)] + (["--trainer"] if options.trainer else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
    if output.returncode and lines:  # every run finished and was reported; a rank failed while leaving
        print(f"note: a rank exited with code {output.returncode} after the results were reported:\n{output.stderr[-600:]}")
    if not lines:
        raise RuntimeError(f"{nproc} processes failed ({output.returncode}):\n{output.stdout[-2000:]}\n{output.stderr[-4000:]}")
    return json.loads(lines[0][len("RESULT ") :])


def report(results: Dict[str, Any], options: argparse.Namespace) -> str:
    """The tables of one process count, as text."""
    from pipeline_runs import ideal_bubble

    ranks, side = results["ranks"], "Trainer (fsdp + pipeline)" if options.trainer else "PipelineRunner"
    lines = [f"{ranks} processes ({ranks} stages), {options.device}, {options.micro_batches} micro-batches of {BATCH} sequences:"]
    lines += [
        f"| schedule | framework ({side}) ms | hand-written ms | ratio | per-round ratios | CPU s per step (all ranks): ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for schedule, rounds in results["ratio"].items():
        framework, raw = statistics.median(rounds["framework"]), statistics.median(rounds["raw"])
        per_round = ", ".join(f"{f / r:.3f}" for f, r in zip(rounds["framework"], rounds["raw"]))
        cpu = "-"
        if rounds.get("framework_cpu"):
            framework_cpu, raw_cpu = statistics.median(rounds["framework_cpu"]), statistics.median(rounds["raw_cpu"])
            cpu = f"{framework_cpu:.3f} / {raw_cpu:.3f} = {framework_cpu / raw_cpu:.3f}"
        lines.append(f"| {schedule} | {framework * 1e3:.1f} | {raw * 1e3:.1f} | {framework / raw:.3f} | {per_round} | {cpu} |")
    lines += [
        "",
        "| schedule | micro-batches | bubble (hand-written) | textbook | bubble (framework) | activations held per rank, MiB |",
    ]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for row in results["table"]:
        raw, framework = row["raw"], row.get("framework")
        ideal = ideal_bubble(row["schedule"], ranks, row["micro_batches"])
        if "refused" in raw:
            lines.append(f"| {row['schedule']} | {row['micro_batches']} | refused by torch: {raw['refused'][:90]} | | | |")
            continue
        memory = " / ".join(f"{b / 2**20:.1f}" for b in raw["activations_per_rank"])
        textbook = "-" if ideal is None else f"{ideal:.2f}"
        ours = "refused (several stages per rank)" if framework is None else f"{framework['bubble']:.2f}"
        lines.append(f"| {row['schedule']} | {row['micro_batches']} | {raw['bubble']:.2f} | {textbook} | {ours} | {memory} |")
    return "\n".join(lines)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="process counts, one torchrun job each")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=3, help="framework / hand-written alternations for the ratio")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches of the ratio runs")
    parser.add_argument("--micro-batch-counts", type=int, nargs="+", default=[2, 4, 8], help="of the bubble table")
    parser.add_argument("--schedules", nargs="*", default=ALL_SCHEDULES, help="of the bubble table (none: no table)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--trainer", action="store_true", help="time Trainer (issue 52's contract), not PipelineRunner")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    for name in ("steps", "rounds", "micro_batches"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(options, name)} is invalid; allowed: an integer >= 1")
    for count in options.micro_batch_counts:
        if count < 1 or BATCH % count:
            parser.error(f"--micro-batch-counts {count} is invalid; allowed: divisors of the batch, {BATCH}")
    if BATCH % options.micro_batches:
        parser.error(f"--micro-batches {options.micro_batches} is invalid; allowed: divisors of the batch, {BATCH}")
    unknown = [name for name in options.schedules if name not in ALL_SCHEDULES]
    if unknown:
        parser.error(f"--schedules {unknown} unknown; allowed: {ALL_SCHEDULES}")
    return options


def main(argv: Optional[List[str]] = None) -> None:
    options = parse(argv)
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
    if options.trainer:
        check_trainer_contract()
    if options.child:
        child(options)
        return
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs seen; model {MODEL}, batch {BATCH}, {options.steps} timed steps")
    for nproc in options.nproc:
        before = os.getloadavg()[0]
        results = launch(options, nproc)
        print(f"load average (1 min) before / after: {before:.1f} / {os.getloadavg()[0]:.1f}")
        print(report(results, options) + "\n", flush=True)


if __name__ == "__main__":
    main()
