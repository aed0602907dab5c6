"""``gpu_batch_size_limit="auto"``: the largest micro-batch whose forward and backward fit in memory."""

import logging
from typing import Any, Callable, List

import torch

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.data.rng import capture_rng_state, restore_rng_state
from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs
from framework.loop.tbptt import split_along_time
from framework.metrics.collector import MetricCollector
from framework.module import ModuleInterface

logger = logging.getLogger("framework")


def candidate_micro_batches(per_process: int) -> List[int]:
    """Sizes to try, largest first: the per-process batch, then repeatedly the largest divisor
    of it at most half the last size (a micro-batch must divide the per-process batch).

    Example:
        >>> candidate_micro_batches(32), candidate_micro_batches(24), candidate_micro_batches(10)
        ([32, 16, 8, 4, 2, 1], [24, 12, 6, 3, 1], [10, 5, 2, 1])
    """
    sizes = [per_process]
    while sizes[-1] > 1:
        sizes.append(max(d for d in range(1, sizes[-1] // 2 + 1) if per_process % d == 0))
    return sizes


def largest_fitting(sizes: List[int], fits: Callable[[int], bool]) -> int:
    """The first of ``sizes`` for which ``fits`` is True; 0 when none does.

    Example:
        >>> largest_fitting([32, 16, 8], lambda size: size <= 20), largest_fitting([2, 1], lambda size: False)
        (16, 0)
    """
    return next((size for size in sizes if fits(size)), 0)


def search_micro_batch(
    module: ModuleInterface,
    backend: TrainerBackend,
    args: TrainerArguments,
    wrapped: torch.nn.Module,
    forward: Callable[..., Any],
    collector: MetricCollector,
) -> int:
    """Probe the module's ``train_step`` and backward on the first batch of a loader of each
    candidate size, on every rank, and return the largest that fits everywhere (the minimum
    over ranks). A probe that raises ``torch.OutOfMemoryError`` does not fit. Nothing of the
    probes remains: gradients are dropped, buffers (batch-norm statistics), the random
    generators and step-logged values are put back.

    The probes run through the strategy's step without gradient synchronisation, so ddp runs
    no gradient all-reduce inside them; ddp's buffer broadcast and fsdp's all-gathers still run
    in forward, so the ranks must run out of memory alike (same devices and batch shapes),
    as they do in a balanced job.
    """
    per_process, device = args.train_batch_size // backend.data_parallel_size, backend.device
    buffers = [buffer.detach().clone() for buffer in module.buffers()]
    rng, logged = capture_rng_state(), collector.state_dict()

    def fits(size: int) -> bool:
        sampler = backend.sampler_factory(shuffle=True, seed=args.seed)
        batch = backend.move_to_device(next(iter(module.get_train_dataloader(sampler, size))))
        tbptt = args.tbptt_steps  # then a step is one chunk along time, with no hidden state yet
        step_inputs = (split_along_time(batch, tbptt)[0], device, None) if tbptt else (batch, device)
        try:
            with backend.no_sync(wrapped, skip_gradient_sync=True):
                backend.backward(as_outputs(forward(Stage.TRAIN, 0, *step_inputs), "train_step")[0])
            return True
        except torch.OutOfMemoryError:
            logger.info("gpu_batch_size_limit='auto': a micro-batch of %d does not fit", size)
            return False
        finally:
            del batch, step_inputs
            backend.discard_gradients(wrapped)  # fsdp keeps a no_sync backward's gradients for the next step
            if device.type == "cuda":
                torch.cuda.empty_cache()

    try:
        size = largest_fitting(candidate_micro_batches(per_process), fits)
    finally:
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), buffers):
                buffer.copy_(saved)
        restore_rng_state(rng)
        collector.load_state_dict(logged, device)
    agreed = backend.min_over_ranks(size)  # every rank agrees before any raises
    if agreed == 0:
        raise RuntimeError(
            "gpu_batch_size_limit='auto': even a micro-batch of 1 runs out of device memory in forward and backward"
            f"{'' if size == 0 else ' on another rank'}; use a smaller model, activation_checkpointing=True, a bf16 "
            "backend, or fsdp"
        )
    return agreed
