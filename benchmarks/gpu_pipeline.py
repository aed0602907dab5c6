"""The GPU tier's pipeline case: ``benchmarks/gpu.py`` under ``torchrun`` with 2 or more GPUs adds a row per
pipeline schedule (``pp-GPipe``, ``pp-1F1B``): the GPT cut into one stage per GPU (``pp`` = the world size,
no data parallelism), the framework's ``PipelineRunner`` against the hand-written ``torch.distributed.pipelining``
loop with the same schedule (``pipeline_runs.py``), alternating, in the same row format as the other backends.

The global batch is the one the ``ddp`` rows train (``--batch-size`` per GPU x GPUs), cut into ``2 x GPUs``
micro-batches; tokens/s counts it once (the stages share it), so MFU per GPU is comparable with ``ddp``'s.
``peak GiB`` is ``torch.cuda.max_memory_allocated`` during the last timed step on the fullest GPU. The figures
are medians of the timed steps after ``warmup`` steps, the slowest rank's; nothing is compiled.
"""

import statistics
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, token_data
from pipeline_runs import Workload, framework_run, hand_written_run

PIPELINE_SCHEDULES = ["GPipe", "1F1B"]


class StagedGPT(GPT):
    """The benchmark GPT whose ``forward`` runs the parts a pipeline stage holds (the others are ``None``).

    Example:
        >>> from gpu_runs import Settings
        >>> model = StagedGPT(Settings(size="tiny").config)
        >>> model.embed = model.position = None  # a later stage receives hidden states
        >>> tuple(model(torch.zeros(1, 32, 64)).shape)
        (1, 32, 128)
    """

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.embed(tokens) + self.position(positions)
        else:
            x = tokens
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def pipeline_workload(config: GPTConfig, batch: int, steps: int, warmup: int) -> Workload:
    """``warmup + steps`` batches of ``batch`` random sequences for the seeded ``StagedGPT``."""
    data = token_data(config, batch * (warmup + steps))
    tokens, targets = data.tensors

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return StagedGPT(config)

    batches = [((tokens[i * batch : (i + 1) * batch],), targets[i * batch : (i + 1) * batch]) for i in range(warmup + steps)]
    return Workload(model=model, blocks="blocks", loss=lm_loss, batches=batches, warmup=warmup)


def _peak_gib(device: torch.device) -> float:
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak) / 2**30


def pipeline_rows(
    settings: Any, repeats: int, device: torch.device, schedules: Optional[List[str]] = None
) -> List[Dict[str, Any]]:
    """One ``gpu.py`` row per schedule, on the process group already joined (``pp`` over every rank)."""
    world_size = dist.get_world_size()
    batch = settings.batch_size * world_size
    micro_batches = 2 * world_size
    work = pipeline_workload(settings.config, batch, settings.steps, settings.warmup)
    rows = []
    for schedule in schedules or PIPELINE_SCHEDULES:
        runs: Dict[str, List[float]] = {"framework": [], "raw": []}
        peaks: Dict[str, float] = {"framework": 0.0, "raw": 0.0}
        for repeat in range(repeats):
            for runner in ("framework", "raw") if repeat % 2 == 0 else ("raw", "framework"):
                run = framework_run if runner == "framework" else hand_written_run
                runs[runner].append(run(work, schedule, micro_batches, device, dist.group.WORLD)["step"])
                peaks[runner] = max(peaks[runner], _peak_gib(device))
        row: Dict[str, Any] = {"backend": f"pp-{schedule}", "compile": False, "micro_batches": micro_batches}
        for runner, seconds in runs.items():
            row[f"{runner}_seconds_per_step"] = statistics.median(seconds)
            row[f"{runner}_tokens_per_s"] = batch * settings.config.sequence / statistics.median(seconds)
            row[f"{runner}_peak_gib"] = peaks[runner]
        row["ratio"] = row["framework_seconds_per_step"] / row["raw_seconds_per_step"]
        rows.append(row)
    return rows
