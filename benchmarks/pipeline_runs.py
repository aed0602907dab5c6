"""The runs ``benchmarks/pipeline.py`` and ``benchmarks/gpu_pipeline.py`` time: one pipeline step of the
framework's path (:class:`~backends.strategies.pipeline_schedule.PipelineRunner`) and of a hand-written
``torch.distributed.pipelining`` loop with the same schedule, on the same model, batches and ranks, with
what they measure per rank: the step time, the compute time inside it (so the bubble), and the bytes of
activations autograd holds for backward at the step's peak.

Measurement:

- compute: the seconds each of the rank's stages spends in ``forward_one_chunk``, ``backward_one_chunk``
  and ``backward_weight_one_chunk`` (torch's schedules call these for every action that computes; the
  receives are waited for outside them) plus the loss; the instance's methods are wrapped, torch is not
  changed;
- CPU time: the seconds of CPU a step costs, summed over the ranks' processes (``time.process_time``, all
  their threads): the work done, which a loaded machine's preemptions do not stretch as they do wall time;
- bubble: ``1 - compute / wall`` of the schedule's ``step`` on each rank: the time a rank waits for its
  neighbours or for communication;
- activations: on CPU the bytes of the tensors autograd saves for backward (parameters excluded, a
  storage counted once), live at the same time, at their peak during the step
  (``torch.autograd.graph.saved_tensors_hooks``); on CUDA ``max_memory_allocated`` above the step's start.
"""

import contextlib
import copy
import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Batch = Tuple[Tuple[torch.Tensor, ...], torch.Tensor]
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclasses.dataclass
class Workload:
    """What both runners train: ``model()`` builds the whole model (seeded: the same weights on every call),
    ``blocks`` names its ``nn.ModuleDict`` / ``nn.ModuleList`` of blocks, ``loss(outputs, target)`` is one
    micro-batch's loss, ``batches`` the steps' whole batches (the first ``warmup`` untimed)."""

    model: Callable[[], torch.nn.Module]
    blocks: str
    loss: Callable[[Any, Any], torch.Tensor]
    batches: List[Batch]
    warmup: int = 1
    measure: bool = True
    """False: time the steps only, without the compute clock and the activation meter (their Python hooks cost
    CPU time), as the ratio runs and the Trainer (which has neither) are timed."""


def stages_per_rank(schedule: str) -> int:
    """1 for torch's single-stage schedules (``GPipe``, ``1F1B``), 2 for the interleaved and V ones.

    Example:
        >>> stages_per_rank("1F1B"), stages_per_rank("Interleaved1F1B"), stages_per_rank("ZBVZeroBubble")
        (1, 2, 2)
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    return 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2


def rank_stages(schedule: str, rank: int, ranks: int) -> List[int]:
    """The stage indices a rank holds: ``[rank]``; ``[rank, rank + ranks]`` for the looped schedules;
    ``[rank, 2 * ranks - 1 - rank]`` for the V ones (the first and last stage on rank 0).

    Example:
        >>> rank_stages("GPipe", 1, 4), rank_stages("Interleaved1F1B", 1, 4), rank_stages("DualPipeV", 1, 4)
        ([1], [1, 5], [1, 6])
    """
    if stages_per_rank(schedule) == 1:
        return [rank]
    return [rank, 2 * ranks - 1 - rank] if schedule in V_SCHEDULES else [rank, rank + ranks]


def ideal_bubble(schedule: str, ranks: int, micro_batches: int) -> Optional[float]:
    """The textbook bubble of equal stages with free communication: ``(p - 1) / (v * m + p - 1)`` for GPipe,
    1F1B (v = 1) and the looped schedules (v = 2 stages per rank); None for the zero-bubble ones, whose
    bubble depends on the ratio of the backward's input and weight parts.

    Example:
        >>> ideal_bubble("1F1B", 2, 4), ideal_bubble("Interleaved1F1B", 2, 4), ideal_bubble("ZBVZeroBubble", 2, 4)
        (0.2, 0.1111111111111111, None)
    """
    if "ZeroBubble" in schedule or schedule in V_SCHEDULES:
        return None
    stages = stages_per_rank(schedule)
    return (ranks - 1) / (stages * micro_batches + ranks - 1)


def hand_written_stage(model: torch.nn.Module, blocks: str, stage: int, stages: int) -> torch.nn.Module:
    """torchtitan's cut, by hand: a copy of the model keeping its share of the blocks (split evenly, the first
    stages one more), the children before the blocks on the first stage, those after them on the last."""
    part = copy.deepcopy(model)
    container = getattr(part, blocks)
    keys = list(container._modules)
    bounds = [len(keys) * index // stages for index in range(stages + 1)]
    keep = set(keys[bounds[stage] : bounds[stage + 1]])
    for key in keys:
        if key not in keep:
            del container._modules[key]
    names = [name for name, _ in part.named_children()]
    position = names.index(blocks)
    for name in names[:position] if stage != 0 else []:
        setattr(part, name, None)
    for name in names[position + 1 :] if stage != stages - 1 else []:
        setattr(part, name, None)
    return part


class StageClock:
    """Seconds spent computing: wraps the compute methods of each given pipeline stage (on the instance)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: Sequence[Any], device: torch.device) -> None:
        self.seconds, self.device = 0.0, device
        for stage in stages:
            for name in self.METHODS:
                setattr(stage, name, self.timed(getattr(stage, name)))

    def timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            synchronize(self.device)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.seconds += time.perf_counter() - started

        return run


class ActivationMeter:
    """Peak bytes of the tensors autograd holds for backward (CPU), or of CUDA memory above the start.

    Example:
        >>> layer = torch.nn.Linear(8, 8)
        >>> with ActivationMeter(layer.parameters(), torch.device("cpu")) as meter:
        ...     loss = layer(torch.ones(4, 8)).relu().sum()
        >>> meter.peak  # the input (4 x 8 floats) and relu's output, kept for backward
        256
    """

    def __init__(self, parameters: Any, device: torch.device) -> None:
        self.device, self.live, self.peak = device, 0, 0
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.holders: Dict[int, List[int]] = {}  # storage -> [holders alive, bytes]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> "ActivationMeter":
        if self.device.type == "cuda":
            synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start

    def pack(self, tensor: torch.Tensor) -> Any:
        pointer = tensor.untyped_storage().data_ptr()
        if self.device.type == "cuda" or pointer in self.parameters or pointer == 0:
            return tensor
        entry = self.holders.setdefault(pointer, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, pointer, self)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, pointer: int) -> None:
        entry = self.holders[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.holders[pointer]


class _Held:
    """A saved tensor; when autograd drops it (after its backward) its bytes leave the meter."""

    def __init__(self, tensor: torch.Tensor, pointer: int, meter: ActivationMeter) -> None:
        self.tensor, self.pointer, self.meter = tensor, pointer, meter

    def __del__(self) -> None:
        self.meter.release(self.pointer)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loss(loss: Callable[[Any, Any], torch.Tensor], clock: List[float]) -> Callable[[Any, Any], torch.Tensor]:
    def run(outputs: Any, target: Any) -> torch.Tensor:
        started = time.perf_counter()
        value = loss(outputs, target)
        clock[0] += time.perf_counter() - started
        return value

    return run


class PreparedRun:
    """One runner, built: its ``step(inputs, target)``, the modules it trains, its clocks and its AdamW; ``run``
    times one step (schedule + optimizer), ``summary`` gathers every rank's figures of the timed steps."""

    def __init__(
        self,
        step: Callable[[Tuple[torch.Tensor, ...], torch.Tensor], None],
        parts: Sequence[torch.nn.Module],
        stages: Sequence[Any],
        loss_clock: List[float],
        device: torch.device,
        measure: bool = True,
    ) -> None:
        self.step, self.device, self.loss_clock = step, device, loss_clock
        self.parameters = [p for part in parts for p in part.parameters()]
        self.measure = measure
        self.clock = StageClock(stages if measure else [], device)
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-3)
        self.steps: List[float] = []
        self.walls: List[float] = []
        self.computes: List[float] = []
        self.peaks: List[int] = []
        self.cpu: List[float] = []

    def run(self, batch: Batch, timed: bool) -> None:
        inputs, target = tuple(t.to(self.device) for t in batch[0]), batch[1].to(self.device)
        self.clock.seconds, self.loss_clock[0] = 0.0, 0.0
        synchronize(self.device)
        started, cpu_started = time.perf_counter(), time.process_time()
        meter = ActivationMeter(self.parameters, self.device)
        with meter if self.measure else contextlib.nullcontext():
            self.step(inputs, target)
        synchronize(self.device)
        scheduled = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        if timed:
            self.cpu.append(time.process_time() - cpu_started)
            self.steps.append(time.perf_counter() - started)
            self.walls.append(scheduled - started)
            self.computes.append(self.clock.seconds + self.loss_clock[0])
            self.peaks.append(meter.peak)

    def summary(self, group: Any) -> Dict[str, Any]:
        mine = {
            "step": statistics.median(self.steps),
            "bubble": 1 - sum(self.computes) / sum(self.walls),
            "activations": max(self.peaks),
            "compute": statistics.median(self.computes),
            "cpu": statistics.median(self.cpu),
        }
        everyone: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        return {
            "step": max(rank["step"] for rank in everyone),  # the slowest rank's median
            "bubble": statistics.mean(rank["bubble"] for rank in everyone),
            "bubble_per_rank": [rank["bubble"] for rank in everyone],
            "activations_per_rank": [rank["activations"] for rank in everyone],
            "compute_per_rank": [rank["compute"] for rank in everyone],
            "cpu": sum(rank["cpu"] for rank in everyone),  # CPU seconds of a step, all ranks' processes
        }


def prepare_framework(workload: Workload, schedule: str, micro_batches: int, device: torch.device, group: Any) -> PreparedRun:
    """The framework's path: ``default_stages`` / ``keep_stage`` cut this rank's stage, ``PipelineRunner`` runs it."""
    from backends.strategies.pipeline_schedule import PipelineRunner
    from backends.strategies.pipeline_stages import default_stages, keep_stage

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    stage = workload.model()
    keep_stage(stage, default_stages(stage, ranks)[rank])
    stage.to(device)
    loss_clock = [0.0]
    loss = timed_loss(workload.loss, loss_clock) if workload.measure else workload.loss
    runner = PipelineRunner(stage, rank, ranks, device, group, schedule, micro_batches, loss)

    def step(inputs: Tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        runner.step(inputs, target)

    return PreparedRun(step, [stage], [runner.schedule._stage], loss_clock, device, workload.measure)


def prepare_hand_written(workload: Workload, schedule: str, micro_batches: int, device: torch.device, group: Any) -> PreparedRun:
    """torch's recipe written out: this rank's stages cut by hand, ``PipelineStage`` each, the schedule class
    by name with the loss and torch's own gradient scaling (``scale_grads=True``: the same gradients as
    dividing each micro-batch's loss by their number)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    stage_ids = rank_stages(schedule, rank, ranks)
    total = ranks * len(stage_ids)
    model = workload.model()
    parts = [hand_written_stage(model, workload.blocks, index, total).to(device) for index in stage_ids]
    stages = [PipelineStage(part, index, total, device, group=group) for part, index in zip(parts, stage_ids)]
    loss_clock = [0.0]
    loss = timed_loss(workload.loss, loss_clock) if workload.measure else workload.loss
    runner = get_schedule_class(schedule)(stages[0] if len(stages) == 1 else stages, n_microbatches=micro_batches, loss_fn=loss)
    first, last = 0 in stage_ids, total - 1 in stage_ids

    def step(inputs: Tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        arguments = inputs if first else ()
        if last:
            runner.step(*arguments, target=target, losses=[], return_outputs=False)
        else:
            runner.step(*arguments, return_outputs=False)

    return PreparedRun(step, parts, stages, loss_clock, device, workload.measure)


def alternating(runs: Dict[str, PreparedRun], workload: Workload, steps: int, group: Any) -> Dict[str, Dict[str, Any]]:
    """Every run takes one step in turn (which goes first alternates), ``workload.warmup`` untimed steps then
    ``steps`` timed ones on the workload's batches in a cycle: each sees the same load on a shared machine."""
    names = list(runs)
    for index in range(workload.warmup + steps):
        batch = workload.batches[index % len(workload.batches)]
        for name in names if index % 2 == 0 else names[::-1]:
            runs[name].run(batch, timed=index >= workload.warmup)
    return {name: run.summary(group) for name, run in runs.items()}


def framework_run(workload: Workload, schedule: str, micro_batches: int, device: torch.device, group: Any) -> Dict[str, Any]:
    """:func:`prepare_framework`'s run alone over the workload's batches."""
    run = prepare_framework(workload, schedule, micro_batches, device, group)
    return alternating({"framework": run}, workload, len(workload.batches) - workload.warmup, group)["framework"]


def hand_written_run(workload: Workload, schedule: str, micro_batches: int, device: torch.device, group: Any) -> Dict[str, Any]:
    """:func:`prepare_hand_written`'s run alone over the workload's batches."""
    run = prepare_hand_written(workload, schedule, micro_batches, device, group)
    return alternating({"raw": run}, workload, len(workload.batches) - workload.warmup, group)["raw"]
