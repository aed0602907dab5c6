"""Runs ``examples/dqn.py``'s DQN (every rank plays its own environment into its own replay
buffer) under torchrun for the RL resume test, and SIGKILLs the whole job at chosen points.

It always resumes with ``resume="auto"``, so running the same command again continues a
killed run. At the end every rank writes ``<out>/result-rank<R>.pt``: the flat parameters
and its own ``get_state()`` (environment, buffer, RNG states).

Kill points (each fires once: a marker file under ``<out>/kills`` records it), on rank 0:
``mb:E:I`` right after micro-batch ``I`` (0-based) of epoch ``E``; ``begin:E`` at the start
of epoch ``E``, just after the previous epoch-end checkpoint was written. There rank 0
SIGKILLs torchrun's process group and every worker's (each worker is its own session), so
the whole job dies at once and torchrun cannot restart it.

Example:
    torchrun --nproc-per-node=2 tests/dqn_script.py /tmp/run --kill mb:1:5   # dies; rerun to finish
"""

import argparse
import os
import signal
import sys
from typing import Any, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from dqn import DQN  # noqa: E402

from toy import flat_parameters  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402
from framework.checkpoint import DefaultCheckpointerArguments  # noqa: E402
from framework.data.rng import seed_everything  # noqa: E402


def kill_whole_job(out: str) -> None:
    """SIGKILL torchrun (its process group when it leads one, never its caller's) and every worker
    (each its own session), this one last."""
    sys.stdout.flush()
    launcher = os.getppid()
    if os.getpgid(launcher) == launcher:
        os.killpg(launcher, signal.SIGKILL)
    else:
        os.kill(launcher, signal.SIGKILL)
    pids = []
    for name in sorted(os.listdir(os.path.join(out, "pids"))):
        with open(os.path.join(out, "pids", name)) as handle:
            pids.append(int(handle.read()))
    for pid in sorted(pids, key=lambda pid: pid == os.getpid()):
        if os.getsid(pid) == pid:  # a torchrun worker leads its own session: never a stranger's group
            os.killpg(pid, signal.SIGKILL)


class Killer(Callback):
    """Kills the whole job at the ``mb:E:I`` and ``begin:E`` kill points (rank 0, each once)."""

    def __init__(self, out: str, specs: List[str]) -> None:
        self.out, self.specs = out, specs
        self.trainer: Any = None
        self.epoch, self.index = 0, 0

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.epoch, self.index = epoch, self.trainer.batches_finished_in_epoch
        if self.index == 0:
            self._maybe_die(f"begin:{epoch}")

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        self._maybe_die(f"mb:{self.epoch}:{self.index}")
        self.index += 1

    def _maybe_die(self, spec: str) -> None:
        if spec not in self.specs:
            return
        os.makedirs(os.path.join(self.out, "kills"), exist_ok=True)
        try:
            open(os.path.join(self.out, "kills", spec.replace(":", "_")), "x").close()
        except FileExistsError:
            return
        print(f"KILLING the whole job at {spec} (step {self.trainer.global_steps_finished})", flush=True)
        kill_whole_job(self.out)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill", action="append", default=[], help="mb:E:I or begin:E (rank 0)")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    os.makedirs(os.path.join(options.out, "pids"), exist_ok=True)
    with open(os.path.join(options.out, "pids", f"rank{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    checkpointer_args = DefaultCheckpointerArguments(
        save_dir=os.path.join(options.out, "checkpoints"), save_every_n_steps=3, keep_last_n=2, resume="auto"
    )
    args = TrainerArguments(
        epochs=options.epochs,
        train_batch_size=16,  # 8 per rank: 8 steps per epoch
        backend="ddp",
        disable_tqdm=True,
        output_dir=options.out,
        seed=7,
        loggers=["csv"],
        checkpointer_args=checkpointer_args,
    )
    seed_everything(args.seed)  # the same initial weights on every run
    module = DQN()
    trainer = Trainer(module, args, callbacks=[Killer(options.out, options.kill if rank == 0 else [])])
    try:
        trainer.train()
    finally:
        trainer.close()
    result = {"params": flat_parameters(module), "step": trainer.global_steps_finished, "state": module.get_state()}
    torch.save(result, os.path.join(options.out, f"result-rank{rank}.pt"))  # each rank its own: the test compares them
    print(f"FINISHED rank {rank} at step {trainer.global_steps_finished}", flush=True)


if __name__ == "__main__":
    main()
