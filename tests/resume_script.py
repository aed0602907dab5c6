"""A small real training run that can SIGKILL itself at chosen points; the resume tests run it.

Run it with python (``--backend sp``) or under torchrun (``--backend ddp``). It always resumes
with ``resume="auto"``, so running the same command again continues a killed run. At the
end rank zero writes ``<out>/result.pt``: the flat parameters and the metric history.

Kill points (each fires once: a marker file under ``<out>/kills`` records it):

- ``mb:E:I``: right after micro-batch ``I`` (0-based, within epoch ``E``) ran its backward;
- ``begin:E``: at the start of epoch ``E`` (just after the previous epoch-end checkpoint);
- ``save:S``: while writing the checkpoint of global step ``S``, after half of the
  temporary file is on disk (rank zero, the writer).

Under torchrun, ``spec@R`` makes rank ``R`` kill itself (default: ``--kill-rank``, 0).

``--send-signal mb:E:I=SIGTERM@R`` instead sends a real signal to this process at that point (once),
so preemption can be tested at chosen steps; ``--step-sleep`` slows every step down so a test
can signal the process from outside while it trains.

Example:
    python tests/resume_script.py /tmp/run --kill mb:1:17 --kill begin:2   # dies, rerun to finish
"""

import argparse
import io
import os
import signal
import sys
import time
from typing import IO, Any, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipelines import train_loader  # noqa: E402
from toy import ToyModule, flat_parameters  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import EMA, SWA, Callback, WeightAveraging  # noqa: E402
from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments  # noqa: E402


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory (checkpoints under <out>/checkpoints)")
    parser.add_argument("--backend", default="sp")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n-train", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch per optimizer step")
    parser.add_argument("--micro", type=int, default=4, help="gpu_batch_size_limit (micro-batch size)")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill", action="append", default=[], help="mb:E:I, begin:E or save:S, optionally @rank")
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--send-signal", action="append", default=[], help="mb:E:I=SIGNAME, optionally @rank")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep in every train_step")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--loggers", default="csv", help="TrainerArguments.loggers, comma-separated")
    parser.add_argument("--ema", type=float, default=None, help="an EMA callback with this decay")
    parser.add_argument("--swa-start", type=int, default=None, help="an SWA callback from this epoch")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory (default <out>/checkpoints)")
    parser.add_argument("--pipeline", default=None, help="a train loader of tests/pipelines.py (default: the toy's)")
    return parser.parse_args(argv)


class LoggingToy(ToyModule):
    """The toy MLP with dropout, which also logs a per-step accuracy (an epoch metric)."""

    step_sleep = 0.0
    pipeline = None

    def get_train_dataloader(self, sampler, batch_size):
        if self.pipeline is None:
            return super().get_train_dataloader(sampler, batch_size)
        return train_loader(self.pipeline, self.train_ds, sampler, batch_size)

    def train_step(self, global_step, batch, device):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        x, y = batch
        logits = self.net(x)
        self.log("train_acc", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)


def _claim(out: str, spec: str) -> bool:
    """True the first time ``spec`` fires (creates its marker), False afterwards."""
    directory = os.path.join(out, "kills")
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, spec.replace(":", "_"))
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return False
    return True


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def specs_for_rank(specs: List[str], rank: int, default_rank: int) -> List[str]:
    """The kill points (without their ``@rank``) that belong to ``rank``."""
    mine = []
    for spec in specs:
        point, _, owner = spec.partition("@")
        if (int(owner) if owner else default_rank) == rank:
            mine.append(point)
    return mine


class Killer(Callback):
    """SIGKILLs this process at the ``mb:`` and ``begin:`` kill points."""

    def __init__(self, out: str, specs: List[str], signals: List[str] = ()) -> None:
        self.out, self.specs = out, specs
        self.signals = [tuple(spec.split("=")) for spec in signals]
        self.trainer: Any = None
        self.epoch, self.index = 0, 0

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.epoch, self.index = epoch, self.trainer.batches_finished_in_epoch
        if self.trainer.batches_finished_in_epoch == 0:
            self._maybe_die(f"begin:{epoch}")

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        self._maybe_die(f"mb:{self.epoch}:{self.index}")
        self.index += 1

    def _maybe_die(self, spec: str) -> None:
        if spec in self.specs and _claim(self.out, spec):
            print(f"KILLING at {spec}", flush=True)
            die()
        for point, name in self.signals:
            if point == spec and _claim(self.out, f"{point}={name}"):
                print(f"SIGNALLING {name} at {spec} (step {self.trainer.global_steps_finished})", flush=True)
                os.kill(os.getpid(), signal.Signals[name])

    def on_begin_train(self, global_step: int) -> None:
        print(f"STARTED at step {global_step}", flush=True)

    def on_end_optimizer_step(self, global_step: int) -> None:
        print(f"STEP {global_step}", flush=True)


class _HalfThenDie(io.RawIOBase):
    """Passes writes through until ``limit`` bytes, then flushes them to disk and SIGKILLs."""

    def __init__(self, handle: IO[bytes], limit: int) -> None:
        self.handle, self.limit, self.written = handle, limit, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        room = self.limit - self.written
        self.handle.write(data[:room])
        self.written += min(len(data), room)
        if self.written >= self.limit:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            print(f"KILLING in the middle of a checkpoint write ({self.written} bytes written)", flush=True)
            die()
        return len(data)


class CrashingCheckpointer(DefaultCheckpointer):
    """Dies half-way through writing the checkpoint of one chosen step (the ``save:S`` kill point)."""

    def __init__(self, *arguments: Any, out: str, specs: List[str], **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        self.out, self.specs = out, specs

    def serialize(self, obj: Any, handle: IO[bytes]) -> None:
        spec = f"save:{obj.get('global_step')}" if isinstance(obj, dict) else ""
        if spec in self.specs and _claim(self.out, spec):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            torch.save(obj, _HalfThenDie(handle, buffer.tell() // 2))
        super().serialize(obj, handle)


def main(argv: Optional[List[str]] = None) -> None:
    options = parse_arguments(argv)
    torch.set_num_threads(1)
    checkpointer_args = DefaultCheckpointerArguments(
        save_dir=options.save_dir or os.path.join(options.out, "checkpoints"),
        save_every_n_steps=options.save_every,
        keep_last_n=options.keep_last,
        keep_best_n=1,
        metric="val_loss",
        resume="auto",
        async_save=options.async_save,
    )
    args = TrainerArguments(
        epochs=options.epochs,
        train_batch_size=options.batch,
        gpu_batch_size_limit=options.micro,
        backend=options.backend,
        log_every_n_steps=5,
        val_every_n_steps=10,
        disable_tqdm=True,
        output_dir=options.out,
        seed=7,
        max_steps=options.max_steps,
        loggers=options.loggers.split(","),
        checkpointer_args=checkpointer_args,
    )
    module = LoggingToy(n_train=options.n_train, n_val=32, dropout=0.2, lr=0.1)
    module.step_sleep = options.step_sleep
    module.pipeline = options.pipeline
    rank = int(os.environ.get("RANK", 0))
    specs = specs_for_rank(options.kill, rank, options.kill_rank)
    checkpointer = CrashingCheckpointer(checkpointer_args, out=options.out, specs=specs)
    killer = Killer(options.out, specs, specs_for_rank(options.send_signal, rank, options.kill_rank))
    averaging: List[WeightAveraging] = [EMA(decay=options.ema)] if options.ema is not None else []
    averaging += (
        [SWA(swa_lrs=0.02, swa_epoch_start=options.swa_start, annealing_epochs=1)] if options.swa_start is not None else []
    )
    trainer = Trainer(module, args, checkpointer=checkpointer, callbacks=[killer, *averaging])
    try:
        history = trainer.train()
    finally:
        trainer.close()
    averages = {type(c).__name__: torch.cat([t.flatten() for t in c.averaged_state_dict().values()]) for c in averaging}
    if trainer.is_main_process:
        torch.save(
            {"params": flat_parameters(module), "history": history.records, "step": trainer.global_steps_finished, **averages},
            os.path.join(options.out, "result.pt"),
        )
        print(f"FINISHED at step {trainer.global_steps_finished}", flush=True)


if __name__ == "__main__":
    main()
