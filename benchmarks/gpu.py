"""GPU throughput of every GPU backend on a small GPT: tokens/s, achieved TFLOP/s and MFU against the
device's dense peak, peak memory, and the ratio to a hand-written loop on the same GPU, with and
without ``torch.compile``. It needs a CUDA device and exits at once without one.

    python benchmarks/gpu.py                                   # sp, sp-amp, sp-bf16 on one GPU
    torchrun --standalone --nproc_per_node=8 benchmarks/gpu.py # ddp*, fsdp* (and their amp, bf16), pp-GPipe, pp-1F1B
    python benchmarks/gpu.py --size medium --batch-size 4 --compile on --json gpu.json

Each (backend, compile) pair runs the framework and the hand-written loop alternately, ``--repeats``
times, in this one process (one NCCL group under torchrun); the figures are medians of the timed steps
after ``--warmup`` steps (compilation happens there). The hand-written loop does what the backend does:
autocast with a GradScaler for fp16, bf16 weights for ``*-bf16``, ``DistributedDataParallel`` or FSDP2
``fully_shard`` of the blocks and root for ``ddp*``/``fsdp*``, each block compiled for compile.
Under torchrun the pipeline rows (``pp-GPipe``, ``pp-1F1B``: one stage per GPU, ``gpu_pipeline.py``) follow,
uncompiled, unless ``--pipeline off``. MFU counts model FLOPs (``gpu_flops.gpt_flops_per_token``) against
the dtype's dense peak of the GPU (``framework/callbacks/gpu_peaks.py``, or ``--peak-tflops``). Record the
figures in docs/benchmarks.md, "GPU".
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

SINGLE_PROCESS = ["sp", "sp-amp", "sp-bf16"]
MULTI_PROCESS = ["ddp", "ddp-amp", "ddp-bf16", "fsdp", "fsdp-amp", "fsdp-bf16"]
NEEDS_CUDA = (
    "benchmarks/gpu.py needs a CUDA device: torch.cuda.is_available() is False here (torch {version}, CUDA build: "
    "{cuda}). Run it on a GPU machine (CONTRIBUTING.md, 'On a GPU machine'); the CPU benchmarks are the others in benchmarks/."
)


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small", "medium"], default="small", help="GPT size (small: GPT-2 124M)")
    parser.add_argument(
        "--backends", nargs="+", default=None, help="backends to run (default: sp* on one process, ddp* and fsdp* under torchrun)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per GPU per step (default 8)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first, compilation included (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="framework/hand-written alternations per row (default 3)")
    parser.add_argument(
        "--compile", choices=["off", "on", "both"], default="both", help="torch.compile the blocks (default both)"
    )
    parser.add_argument(
        "--amp-dtype", choices=["float16", "bfloat16"], default=None, help="sp-amp/ddp-amp dtype (default: fp16 + GradScaler)"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s of one GPU (default: the table)")
    parser.add_argument(
        "--tf32", action="store_true", help="allow TF32 matmuls for the fp32 backends (MFU against the TF32 peak)"
    )
    parser.add_argument(
        "--pipeline", choices=["on", "off"], default="on", help="under torchrun, the pp-GPipe and pp-1F1B rows (default on)"
    )
    parser.add_argument("--json", default=None, help="also write the header and rows to this JSON file")
    args = parser.parse_args(argv)
    for name in ("batch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid; allowed: an integer >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} is invalid; allowed: an integer >= 0")
    return args


def peak_dtype(backend: str, amp_dtype: Optional[str], tf32: bool) -> str:
    """Which of the GPU's peaks a backend's matmuls run at (``gpu_flops.DTYPES``).

    Example:
        >>> peak_dtype("sp", None, False), peak_dtype("ddp-amp", None, False), peak_dtype("fsdp-amp", None, False)
        ('fp32', 'fp16', 'bf16')
    """
    if backend.endswith("-bf16") or backend == "fsdp-amp":
        return "bf16"
    if backend.endswith("-amp"):
        return "bf16" if amp_dtype == "bfloat16" else "fp16"
    return "tf32" if tf32 else "fp32"


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_arguments(argv)
    import torch  # after --help, which needs no torch

    if not torch.cuda.is_available():
        print(NEEDS_CUDA.format(version=torch.__version__, cuda=torch.version.cuda or "none"), file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gpu_runs import Settings, run_rows  # the framework and torch.distributed: only with a GPU

    world = int(os.environ.get("WORLD_SIZE", "1"))
    backends = args.backends or (MULTI_PROCESS if world > 1 else SINGLE_PROCESS)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    settings = Settings(args.size, args.batch_size, args.steps, args.warmup, args.amp_dtype)
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    from gpu_pipeline import PIPELINE_SCHEDULES

    pipeline = PIPELINE_SCHEDULES if args.pipeline == "on" else []
    header, rows = run_rows(settings, backends, compiles, args.repeats, pipeline_schedules=pipeline)
    if header["rank"] != 0:
        return 0
    add_utilisation(header, rows, args.amp_dtype, args.tf32, args.peak_tflops)
    print_table(header, rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"header": header, "rows": rows}, handle, indent=2)
    return 0


def add_utilisation(
    header: Dict[str, Any], rows: List[Dict[str, Any]], amp_dtype: Optional[str], tf32: bool, given_peak: Optional[float]
) -> None:
    """Add the GPU's label to ``header`` and, to each row, the achieved TFLOP/s per GPU and MFU of both
    runners against the peak of the dtype the backend computes in."""
    from gpu_flops import achieved_tflops, known_gpu, mfu, peak_tflops

    found = known_gpu(header["device"])
    header["gpu"] = found[0] if found else ("--peak-tflops" if given_peak else "unknown: pass --peak-tflops")
    for row in rows:
        dtype = peak_dtype(row["backend"], amp_dtype, tf32)
        peak = peak_tflops(header["device"], dtype, given_peak)
        for runner in ("framework", "raw"):
            per_gpu = row[f"{runner}_tokens_per_s"] / header["world_size"]
            row[f"{runner}_tflops"] = achieved_tflops(per_gpu, header["flops_per_token"])
            row[f"{runner}_mfu"] = mfu(per_gpu, header["flops_per_token"], peak)
        row["peak_dtype"], row["peak_tflops"] = dtype, peak


def percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def print_table(header: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    print(
        f"{header['device']} ({header['gpu']}) x{header['world_size']}, torch {header['torch']}, CUDA {header['cuda']}, "
        f"{header['date']}\nGPT {header['size']}: {header['parameters'] / 1e6:.0f}M parameters, "
        f"{header['flops_per_token'] / 1e9:.2f} GFLOP/token, {header['batch_size']} x {header['sequence']} tokens per GPU, "
        f"median of {header['repeats']} runs of {header['steps']} steps"
    )
    print(
        f"{'backend':<10} {'compile':<7} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak':>5} {'peak GiB':>8} "
        f"{'raw tok/s':>10} {'raw MFU':>7} {'raw GiB':>7} {'time ratio':>10}"
    )
    for row in rows:
        print(
            f"{row['backend']:<10} {'on' if row['compile'] else 'off':<7} {row['framework_tokens_per_s']:>10.0f} "
            f"{row['framework_tflops']:>8.1f} {percent(row['framework_mfu']):>6} {row['peak_dtype']:>5} "
            f"{row['framework_peak_gib']:>8.2f} {row['raw_tokens_per_s']:>10.0f} {percent(row['raw_mfu']):>7} "
            f"{row['raw_peak_gib']:>7.2f} {row['ratio']:>10.3f}"
        )
    print("time ratio: the framework's seconds per step over the hand-written loop's (target <= 1.05)")


if __name__ == "__main__":
    sys.exit(main())
