"""Throughput: samples and optimizer steps per second, model FLOPs utilisation and peak
device memory, recorded at each log point without a host sync of its own."""

import time
from typing import Dict, Optional

import torch

from framework.callbacks.base import Callback
from framework.callbacks.gpu_peaks import known_gpu

KNOWN_PEAK_FLOPS: Dict[str, float] = {}
"""Your own GPUs' dense peaks (FLOP/s) by device-name fragment, looked up before the published table
(``framework.callbacks.gpu_peaks.KNOWN_GPUS``: H100 SXM/PCIe/NVL, H200, A100, L4, L40S, A10G, RTX 4090...)."""


def known_peak_flops(device: torch.device) -> Optional[float]:
    """The dense bf16 peak of ``device`` in FLOP/s (fp16 on GPUs without bf16): a ``KNOWN_PEAK_FLOPS``
    entry whose fragment is in the device's name, else the published table's; None when neither knows it.

    Example:
        >>> known_peak_flops(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    mine = next((peak for fragment, peak in KNOWN_PEAK_FLOPS.items() if fragment in name), None)
    if mine is not None:
        return mine
    found = known_gpu(name)
    return None if found is None else 1e12 * found[1].get("bf16", found[1]["fp16"])


class Throughput(Callback):
    """Record ``samples_per_second`` and ``steps_per_second`` (optimizer steps) over each
    ``log_every_n_steps`` interval, plus ``mfu`` (model FLOPs utilisation) when the module
    has a ``flops_per_sample`` attribute (training FLOPs of one sample, forward and backward)
    and a peak is known, and ``peak_memory_gib`` (``torch.cuda.max_memory_allocated``) on CUDA.

    Times are host clocks read at log points: no sync is added. The loss read-back at each
    log point keeps the host less than an interval ahead of the device, so in steady state
    the rate is the device's; the first interval includes warm-up. Validation and
    checkpoint saves inside an interval count in its time. Samples are
    ``train_batch_size`` per optimizer step (a partial last cycle counts as a full one).

    Args:
        peak_flops: peak FLOP/s of one device for ``mfu``; None: the published bf16 peak of a
            known GPU (:func:`known_peak_flops`), else no ``mfu``.

    Example:
        trainer = Trainer(module, TrainerArguments(profiler="throughput"))  # or callbacks=[Throughput()]
        trainer.train()
        trainer.history.latest("samples_per_second")
    """

    def __init__(self, peak_flops: Optional[float] = None) -> None:
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"Throughput(peak_flops={peak_flops!r}) is invalid; allowed: None or FLOP/s > 0")
        self.peak_flops = peak_flops
        self._peak: Optional[float] = peak_flops
        self._last_time: Optional[float] = None
        self._last_step = 0

    def on_begin_train(self, global_step: int) -> None:
        if self.peak_flops is None:
            self._peak = known_peak_flops(self.trainer.device)
        self._last_time, self._last_step = time.perf_counter(), global_step

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step % self.trainer.args.log_every_n_steps or self._last_time is None:
            return
        now = time.perf_counter()
        seconds, steps = now - self._last_time, global_step - self._last_step
        self._last_time, self._last_step = now, global_step
        if seconds <= 0 or steps <= 0:
            return
        self.trainer.log_metrics(self.measure(steps, seconds))

    def measure(self, steps: int, seconds: float) -> Dict[str, float]:
        """The metrics of ``steps`` optimizer steps that took ``seconds``."""
        trainer = self.trainer
        samples_per_second = steps * trainer.args.train_batch_size / seconds
        metrics = {"samples_per_second": samples_per_second, "steps_per_second": steps / seconds}
        flops_per_sample = getattr(trainer.module, "flops_per_sample", None)
        if flops_per_sample and self._peak:
            metrics["mfu"] = samples_per_second * float(flops_per_sample) / (self._peak * trainer.backend.world_size)
        if trainer.device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        return metrics
