"""The runs ``benchmarks/gpu.py`` times: the framework's backend and the hand-written loop that does
the same, on the same GPT, data and device (``device`` may be the CPU: the tests run a tiny one there)."""

import dataclasses
import datetime
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from gpt import GPT, SIZES, GPTConfig, GPTModule, lm_loss, make_optimizer, token_data
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback


@dataclasses.dataclass(frozen=True)
class Settings:
    size: str = "small"
    batch_size: int = 8
    steps: int = 30
    warmup: int = 10
    amp_dtype: Optional[str] = None  # sp-amp / ddp-amp (None: the framework's default, fp16 on CUDA)

    @property
    def config(self) -> GPTConfig:
        return SIZES[self.size]


@dataclasses.dataclass
class Measurement:
    seconds_per_step: float
    peak_bytes: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(Callback):
    """Times the optimizer steps after the first ``warmup`` (synchronizing the device twice only)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.count, self.started, self.seconds = 0, 0.0, 0.0

    def on_begin_train(self, global_step: int) -> None:
        if self.warmup == 0:
            synchronize(self.trainer.device)
            self.started = time.perf_counter()

    def on_end_optimizer_step(self, global_step: int) -> None:
        self.count += 1
        if self.count == self.warmup:
            synchronize(self.trainer.device)
            self.started = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            synchronize(self.trainer.device)
            self.seconds = time.perf_counter() - self.started


def amp_dtype_for(backend: str, settings: Settings, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of a backend as the framework picks it (None: no autocast)."""
    if backend == "fsdp-amp":
        return torch.bfloat16
    if not backend.endswith("-amp"):
        return None
    name = settings.amp_dtype or ("float16" if device.type == "cuda" else "bfloat16")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def samples_needed(settings: Settings) -> int:
    return settings.batch_size * world()[1] * (settings.warmup + settings.steps)


def framework_run(backend: str, compile: bool, settings: Settings, device: torch.device) -> Measurement:
    """The framework's ``backend`` on the GPT: ``warmup + steps`` optimizer steps, the last ``steps`` timed."""
    module = GPTModule(settings.config, samples_needed(settings))
    clock = StepClock(settings.warmup, settings.steps)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainerArguments(
            epochs=1,
            max_steps=settings.warmup + settings.steps,
            train_batch_size=settings.batch_size * world()[1],
            backend=backend,
            amp_dtype=settings.amp_dtype if backend in ("sp-amp", "ddp-amp") else None,
            compile=compile,
            use_gpu=device.type == "cuda",
            val_every_n_epochs=0,
            log_every_n_steps=settings.warmup + settings.steps,  # losses read back once, as the raw loop does
            disable_tqdm=True,
            model_summary=False,
            log_level="WARNING",
            output_dir=output_dir,
            loggers=[],
            checkpointer_args={"period": 0, "save_at_end": False},
        )
        reset_peak(device)
        Trainer(module, args, callbacks=[clock]).train()
    return Measurement(clock.seconds / settings.steps, peak(device))


def raw_run(backend: str, compile: bool, settings: Settings, device: torch.device) -> Measurement:
    """The hand-written loop that does what ``backend`` does, on the same GPT and data."""
    rank, world_size = world()
    family = backend.split("-")[0]
    torch.manual_seed(0)
    model = GPT(settings.config).to(device)
    if backend.endswith("-bf16"):
        model = model.to(torch.bfloat16)
    dtype = amp_dtype_for(backend, settings, device)
    if family == "fsdp" and world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    if compile:
        for block in model.blocks:
            block.compile()
    trained: torch.nn.Module = model
    if family == "ddp" and world_size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 and family != "fsdp" else None
    data = token_data(settings.config, samples_needed(settings))
    sampler = (
        DistributedSampler(data, world_size, rank, seed=0)
        if world_size > 1
        else RandomSampler(data, generator=torch.Generator().manual_seed(0))
    )
    loader = DataLoader(data, batch_size=settings.batch_size, sampler=sampler, pin_memory=device.type == "cuda", drop_last=True)
    reset_peak(device)
    total, started = torch.zeros((), device=device), time.perf_counter()
    for step, (tokens, targets) in enumerate(loader):
        if step == settings.warmup:
            synchronize(device)
            started = time.perf_counter()
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = lm_loss(trained(tokens), targets)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total += loss.detach()
    total.item()  # the loss read back once, at the end
    synchronize(device)
    return Measurement((time.perf_counter() - started) / settings.steps, peak(device))


def parameter_count(config: GPTConfig) -> int:
    """The GPT's parameters, counted without allocating them."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def compare(backend: str, compile: bool, settings: Settings, repeats: int, device: torch.device) -> Dict[str, Any]:
    """One table row: framework and hand-written runs alternating (which goes first alternates too)."""
    runs: Dict[str, List[Measurement]] = {"framework": [], "raw": []}
    for repeat in range(repeats):
        order = ("framework", "raw") if repeat % 2 == 0 else ("raw", "framework")
        for runner in order:
            run = framework_run if runner == "framework" else raw_run
            runs[runner].append(run(backend, compile, settings, device))
    tokens_per_step = settings.batch_size * world()[1] * settings.config.sequence
    row: Dict[str, Any] = {"backend": backend, "compile": compile}
    for runner, measured in runs.items():
        seconds = statistics.median(m.seconds_per_step for m in measured)
        row[f"{runner}_seconds_per_step"] = seconds
        row[f"{runner}_tokens_per_s"] = tokens_per_step / seconds
        row[f"{runner}_peak_gib"] = max(m.peak_bytes for m in measured) / 2**30
    row["ratio"] = row["framework_seconds_per_step"] / row["raw_seconds_per_step"]
    return row


def run_rows(
    settings: Settings,
    backends: List[str],
    compiles: List[bool],
    repeats: int,
    device: Optional[torch.device] = None,
    pipeline_schedules: Sequence[str] = (),
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Every (backend, compile) row, then with 2 or more ranks a row per pipeline schedule
    (``gpu_pipeline.py``), and the header that says where they were measured. Under torchrun one process
    group (NCCL on CUDA) serves every run; it is left again at the end."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device or torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    joined = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    try:
        rows = [compare(backend, compile, settings, repeats, device) for compile in compiles for backend in backends]
        rank, world_size = world()
        if pipeline_schedules and world_size > 1:
            from gpu_pipeline import pipeline_rows

            rows += pipeline_rows(settings, repeats, device, list(pipeline_schedules))
    finally:
        if joined:
            dist.destroy_process_group()
    config = settings.config
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world_size": world_size,
        "rank": rank,
        "size": settings.size,
        "parameters": parameter_count(config),
        "flops_per_token": config.flops_per_token,
        "batch_size": settings.batch_size,
        "sequence": config.sequence,
        "steps": settings.steps,
        "repeats": repeats,
    }
    return header, rows
