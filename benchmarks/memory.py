"""What true bf16 and activation checkpointing save: state bytes, activation memory, step time.

One process trains the benchmark transformer (tests/tiny_transformer.py scaled up: width 256,
4 blocks, sequences of 128 tokens, AdamW) for a few steps with each setting, and reports:

- state bytes: parameters + gradients + optimizer state after the first step, for ``sp``
  (fp32), ``sp-amp`` (fp32 weights, bf16 autocast) and ``sp-bf16`` (everything bf16);
- memory of one training step with and without ``activation_checkpointing``:
  ``torch.cuda.max_memory_allocated`` on CUDA, else the bytes autograd keeps for backward
  (``torch.autograd.graph.saved_tensors_hooks``: the activations) on CPU;
- median step time of every setting.

    python benchmarks/memory.py [--steps 8] [--width 256] [--length 128]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from tiny_transformer import TinyTransformer  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402


class StepClock(Callback):
    """Wall time of every optimizer step (synchronised on CUDA) and the state bytes after the first."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self.state_bytes = 0
        self._last = time.perf_counter()

    def on_end_optimizer_step(self, global_step: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        if global_step == 1:
            trainer = self.trainer
            parameters = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
            optimizer = sum(
                t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim()
            )
            self.state_bytes = 2 * parameters + optimizer  # a gradient per parameter, in its dtype


def peak_step_bytes(module: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak memory of one forward and backward above what was allocated before it."""
    loss_of = lambda: torch.nn.functional.cross_entropy(module(tokens).flatten(0, 1).float(), targets.flatten())  # noqa: E731
    if tokens.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss_of().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    saved: List[int] = []  # CPU: the bytes autograd keeps for backward (the activations)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of()
    loss.backward()
    return sum(saved)


def run(backend: str, steps: int, width: int, length: int, checkpointing: bool, directory: str) -> Dict[str, Any]:
    module = TinyTransformer(samples=16 * steps, length=length, vocab=256, width=width, depth=4, lr=1e-3)
    args = TrainerArguments(
        epochs=1,
        train_batch_size=16,
        backend=backend,
        activation_checkpointing=checkpointing,
        disable_tqdm=True,
        log_level="WARNING",
        model_summary=False,
        sanity_val_steps=0,
        max_val_steps_per_epoch=1,
        output_dir=directory,
        log_every_n_steps=steps,
    )
    args.checkpointer_args.save_at_end, args.checkpointer_args.period = False, 0
    clock = StepClock()
    trainer = Trainer(module, args, callbacks=[clock])
    trainer.train()
    tokens, targets = (t.to(trainer.device) for t in module.train_ds.tensors)
    module.train()
    peak = peak_step_bytes(module, tokens[:16], targets[:16])
    trainer.close()
    return {"state": clock.state_bytes, "peak": peak, "median_step_s": statistics.median(clock.times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--length", type=int, default=128)
    options = parser.parse_args()
    torch.set_num_threads(1)
    settings = [("sp", False), ("sp-amp", False), ("sp-bf16", False), ("sp", True), ("sp-bf16", True)]
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for index, (backend, checkpointing) in enumerate(settings):
            out = os.path.join(directory, str(index))
            results[(backend, checkpointing)] = run(backend, options.steps, options.width, options.length, checkpointing, out)
    fp32 = results[("sp", False)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {device}, width {options.width}, 4 blocks, {options.length} tokens, batch 16, AdamW")
    print(f"{'setting':<32} {'state MB':>9} {'/ fp32':>7} {'step mem MB':>13} {'/ fp32':>7} {'step ms':>8} {'/ fp32':>7}")
    for (backend, checkpointing), figures in results.items():
        name = backend + (" + activation_checkpointing" if checkpointing else "")
        print(
            f"{name:<32} {figures['state'] / 1e6:>9.2f} {figures['state'] / fp32['state']:>7.2f} "
            f"{figures['peak'] / 1e6:>13.2f} {figures['peak'] / fp32['peak']:>7.2f} "
            f"{figures['median_step_s'] * 1e3:>8.1f} {figures['median_step_s'] / fp32['median_step_s']:>7.2f}"
        )


if __name__ == "__main__":
    main()
