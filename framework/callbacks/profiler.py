"""TorchProfiler: torch.profiler traces of a few training steps, for TensorBoard and Perfetto."""

import os
from typing import Optional

from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from framework.callbacks.base import Callback


class TorchProfiler(Callback):
    """Profile optimizer steps on rank zero with ``torch.profiler``: skip ``wait`` steps, warm
    up ``warmup``, record ``active``, ``repeat`` times (0: until training ends), and write each
    recorded window as a Chrome trace (``*.pt.trace.json``) under ``<output_dir>/profiler/``,
    which TensorBoard's profiler plugin and https://ui.perfetto.dev open.

    The profiler steps after each optimizer step (``on_end_optimizer_step``), so a recorded
    step is everything from one optimizer step to the next: forward, backward, the step and
    its collectives. CUDA kernels are recorded when training runs on a GPU. Other ranks do
    nothing.

    Args:
        wait: steps skipped first (the first steps allocate and compile).
        warmup: steps profiled but discarded.
        active: steps recorded per window.
        repeat: windows to record (0: keep recording windows until training ends).
        record_shapes: record operator input shapes.
        profile_memory: record tensor allocations (the memory view).
        with_stack: record Python stacks (large traces).

    Example:
        trainer = Trainer(module, TrainerArguments(profiler="torch"))  # these defaults
        trainer = Trainer(module, args, callbacks=[TorchProfiler(wait=5, active=10)])
        # tensorboard --logdir outputs/profiler   (pip install torch-tb-profiler)
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"TorchProfiler({name}={value!r}) is invalid; allowed: an integer >= {least}")
        self.schedule = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.profiler: Optional[profile] = None
        self.trace_dir: Optional[str] = None

    def on_begin_train(self, global_step: int) -> None:
        trainer = self.trainer
        if not trainer.is_main_process or trainer.args.fast_dev_run:  # fast_dev_run writes no files
            return
        self.trace_dir = os.path.join(trainer.args.output_dir, "profiler")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
        self.profiler = profile(
            activities=activities,
            schedule=self.schedule,
            on_trace_ready=tensorboard_trace_handler(self.trace_dir, worker_name="rank0"),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self.profiler.start()

    def on_end_optimizer_step(self, global_step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_end_train(self, global_step: int) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()  # writes a window still being recorded
