"""FSDP vs DDP on 2 ranks (per-rank state and peak memory, step time), and compile vs eager.

Both backends train the same small transformer (tests/tiny_transformer.py scaled up: width
128, 4 blocks, AdamW) on the same process group; each figure is a ratio fsdp / ddp:

- state bytes per rank: parameters + gradients + optimizer state this rank holds;
- median step time (slowest rank).

``--compile`` (run with plain ``python``) instead times ``sp`` with ``compile=True``
against eager: first step (compilation), then median step time after it.

    torchrun --nproc_per_node=2 benchmarks/fsdp.py [--steps 20]
    python benchmarks/fsdp.py --compile [--steps 20]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from tiny_transformer import TinyTransformer  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402


class StepClock(Callback):
    """Wall time of every optimizer step."""

    def __init__(self) -> None:
        self.times, self._last = [], None

    def on_begin_train(self, global_step):
        self._last = time.perf_counter()

    def on_end_optimizer_step(self, global_step):
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def run(backend: str, steps: int, compile: bool = False) -> Dict[str, float]:
    module = TinyTransformer(samples=16 * steps, length=32, width=128, depth=4, lr=1e-3)
    clock = StepClock()
    args = TrainerArguments(
        epochs=1,
        train_batch_size=16,
        backend=backend,
        disable_tqdm=True,
        sanity_val_steps=0,
        val_every_n_epochs=0,
        output_dir=tempfile.mkdtemp(),
        compile=compile,
        log_every_n_steps=10**6,
    )
    args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, False
    trainer = Trainer(module, args, callbacks=[clock])
    holder = []

    class KeepState(Callback):  # measure state right after the last backward, gradients still there
        def on_end_backward(self, global_step, loss):
            params = list(trainer.module.parameters())
            optimizer_state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0]
            holder[:] = [
                local_bytes(params) + local_bytes(p.grad for p in params if p.grad is not None) + local_bytes(optimizer_state)
            ]

    trainer.callbacks.append(KeepState())
    trainer.hooks.refresh()
    trainer.train()
    times = trainer.backend.all_gather_object(clock.times)
    slowest = [max(step) for step in zip(*times)]
    return {
        "state_bytes": holder[0],
        "first_step_s": slowest[0],
        "median_step_s": statistics.median(slowest[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.compile:
        eager, compiled = run("sp", options.steps), run("sp", options.steps, compile=True)
        print(
            f"compile: first step {compiled['first_step_s']:.1f} s (eager {eager['first_step_s']:.3f} s); "
            f"median step compiled/eager = {compiled['median_step_s'] / eager['median_step_s']:.2f} "
            f"({compiled['median_step_s'] * 1e3:.1f} ms / {eager['median_step_s'] * 1e3:.1f} ms)"
        )
        return
    dist.init_process_group("gloo")
    fsdp = run("fsdp", options.steps)
    ddp = run("ddp", options.steps)
    if dist.get_rank() == 0:
        for name in ("state_bytes", "median_step_s"):
            print(f"{name}: fsdp {fsdp[name]:.4g}  ddp {ddp[name]:.4g}  fsdp/ddp = {fsdp[name] / ddp[name]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
