"""The ``model-parallel`` backend against a hand-written loop on the same ("dp", "tp") mesh.

Both train the example's llama-style model (``examples/model_parallel.py``, scaled up: width 256,
4 blocks, SwiGLU 768, sequences of 64 tokens) with AdamW and gradient clipping at norm 1.0.
The hand-written loop does what the backend does, by hand: ``parallelize_module`` with the
model's plan on ``tp``, ``fully_shard`` of every block and of the root on ``dp``, AdamW, and the
same clipping (``backends.strategies.gradient_clipping.clip_gradients``: plain ``clip_grad_norm_`` refuses
the mix of meshes). Each run is a fresh ``torchrun`` launch; runs alternate raw, framework, raw,
framework... Figures:

- per-step ratio framework / raw: median over the steps after the first five (slowest rank),
  the ratio of the medians over rounds;
- parameter + optimizer-state bytes per rank (the largest rank) as a fraction of one process's
  (the same model and AdamW in one plain process): about ``1 / (dp x tp)``, more where the plan
  leaves layers whole (embeddings, norms, head: ``1 / dp``).

    python benchmarks/model_parallel.py [--nproc 4] [--tp 2] [--steps 20] [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 16
MODEL = dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, hidden_dim=768, seq_len=64)


def _model(steps: int) -> Any:
    import torch

    sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
    from model_parallel import LlamaArguments, TinyLlama

    torch.manual_seed(0)
    return TinyLlama(LlamaArguments(**MODEL, samples=BATCH * steps, learning_rate=1e-3))


def _state_bytes(module: Any, optimizer: Any) -> int:
    tensors = list(module.parameters()) + [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _slowest_median(step_times: List[float]) -> float:
    import torch
    import torch.distributed as dist

    median = torch.tensor(statistics.median(step_times[5:] or step_times))
    if dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def raw(steps: int, tp: int) -> Dict[str, float]:
    """The hand-written loop on the same mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from backends.strategies.gradient_clipping import clip_gradients

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model(steps)
    parallelize_module(model, mesh["tp"], model.tensor_parallel_plan())
    if dp > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = model.train_ds.tensors[0]
    per_rank, dp_rank = BATCH // dp, rank // tp
    times, last = [], time.perf_counter()
    for step in range(steps):
        batch = tokens[step * BATCH : (step + 1) * BATCH][dp_rank::dp][:per_rank]
        loss = model.loss((batch,))
        loss.backward()
        clip_gradients(list(model.parameters()), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # the framework reads losses back at log points; one sync per step here is the stricter side
        now = time.perf_counter()
        times.append(now - last)
        last = now
    result = {"step": _slowest_median(times), "bytes": _max_bytes(_state_bytes(model, optimizer))}
    dist.destroy_process_group()
    return result


def _max_bytes(value: int) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(float(value))
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def framework(steps: int, tp: int) -> Dict[str, float]:
    """The same training through ``Trainer`` with the ``model-parallel`` backend."""
    sys.path[:0] = [ROOT]
    from framework import Trainer, TrainerArguments
    from framework.callbacks import Callback

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: List[float] = []
            self.last = 0.0

        def on_begin_train(self, global_step: int) -> None:
            self.last = time.perf_counter()

        def on_end_optimizer_step(self, global_step: int) -> None:
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    clock = StepClock()
    args = TrainerArguments(
        epochs=1,
        train_batch_size=BATCH,
        backend="model-parallel",
        tensor_parallel_size=tp,
        clip_grads=True,
        max_grad_norm=1.0,
        disable_tqdm=True,
        val_every_n_epochs=0,
        log_every_n_steps=10**6,
        loggers=[],
        model_summary=False,
        output_dir=tempfile.mkdtemp(),
        log_level="WARNING",
    )
    args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, False
    trainer = Trainer(_model(steps), args, callbacks=[clock])
    trainer.train()
    return {"step": _slowest_median(clock.times), "bytes": _max_bytes(_state_bytes(trainer.module, trainer.optimizers[0]))}


def single(steps: int) -> Dict[str, float]:
    """Parameter + optimizer-state bytes of the model and AdamW in one plain process."""
    import torch

    model = _model(steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.loss((model.train_ds.tensors[0][:2],)).backward()
    optimizer.step()
    return {"bytes": float(_state_bytes(model, optimizer))}


def _launch(child: str, nproc: int, steps: int, tp: int) -> Dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if child == "single":
        command = [sys.executable]
    command += [os.path.abspath(__file__), "--child", child, "--steps", str(steps), "--tp", str(tp)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
    if output.returncode or not lines:
        raise RuntimeError(f"{child} failed ({output.returncode}):\n{output.stdout[-2000:]}\n{output.stderr[-4000:]}")
    return json.loads(lines[0][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["raw", "framework", "single"])
    options = parser.parse_args()
    if options.child:
        import torch

        torch.set_num_threads(1)
        runner = {"raw": raw, "framework": framework}.get(options.child)
        result = runner(options.steps, options.tp) if runner else single(options.steps)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    dp = options.nproc // options.tp
    runs: Dict[str, List[Dict[str, float]]] = {"raw": [], "framework": []}
    for round_ in range(options.rounds):
        for child in ("raw", "framework"):
            runs[child].append(_launch(child, options.nproc, options.steps, options.tp))
            print(f"round {round_ + 1} {child}: {runs[child][-1]['step'] * 1000:.1f} ms/step", flush=True)
    one = _launch("single", 1, options.steps, options.tp)["bytes"]
    raw_step = statistics.median(run["step"] for run in runs["raw"])
    framework_step = statistics.median(run["step"] for run in runs["framework"])
    per_round = [f["step"] / r["step"] for f, r in zip(runs["framework"], runs["raw"])]
    print(f"mesh {dp}x{options.tp} (dp x tp), {options.steps} steps of {BATCH} x {MODEL['seq_len']} tokens, gloo on CPU")
    print(f"step: framework {framework_step * 1000:.1f} ms, raw {raw_step * 1000:.1f} ms, ratio {framework_step / raw_step:.3f}")
    print(f"per-round ratios: {', '.join(f'{ratio:.3f}' for ratio in per_round)}")
    framework_bytes = runs["framework"][-1]["bytes"]
    print(
        f"parameter + optimizer bytes per rank: framework {framework_bytes / 2**20:.2f} MiB, raw "
        f"{runs['raw'][-1]['bytes'] / 2**20:.2f} MiB, one process {one / 2**20:.2f} MiB: "
        f"{framework_bytes / one:.3f} of one process (1 / (dp x tp) = {1 / options.nproc:.3f})"
    )


if __name__ == "__main__":
    main()
