"""A slow real training run for the run-lock tests: the same command started twice is a double submit.

Prints ``STEP <n>`` after every optimizer step and saves a checkpoint every step
(``resume="auto"``, newest 3 kept). ``--stale`` and ``--heartbeat`` shorten the lock's windows
(:data:`framework.run.run_lock.STALE_AFTER_SECONDS`, ``HEARTBEAT_SECONDS``) so a test can pause
a run past them. Exit status 3 with ``LOCK LOST: ...`` when the run stopped because its lock was
taken over; ``REFUSED: ...`` and status 4 when a live run holds the directory.

Example:
    python tests/lock_script.py /tmp/run --stale 2 --heartbeat 0.2 --step-sleep 0.1
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from toy import ToyModule  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402
from framework.checkpoint import DefaultCheckpointerArguments  # noqa: E402
from framework.run import run_lock  # noqa: E402


class Slow(ToyModule):
    step_sleep = 0.0

    def train_step(self, global_step, batch, device):
        time.sleep(self.step_sleep)
        return super().train_step(global_step, batch, device)


class Steps(Callback):
    def on_end_optimizer_step(self, global_step: int) -> None:
        print(f"STEP {global_step}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--stale", type=float, default=2.0)
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--save-dir", default=None)
    parser.add_argument("--resume", default="auto")
    options = parser.parse_args()
    run_lock.STALE_AFTER_SECONDS, run_lock.HEARTBEAT_SECONDS = options.stale, options.heartbeat
    module = Slow(n_train=64, scheduler=None, val_loaders=0)
    module.step_sleep = options.step_sleep
    checkpoints = DefaultCheckpointerArguments(
        period=0, save_every_n_steps=1, keep_last_n=3, resume=options.resume or None, save_dir=options.save_dir
    )
    args = TrainerArguments(
        epochs=options.epochs,
        train_batch_size=16,
        seed=0,
        disable_tqdm=True,
        log_level="WARNING",
        plot_metrics=False,
        output_dir=options.out,
        checkpointer_args=checkpoints,
    )
    trainer = Trainer(module, args, callbacks=[Steps()])
    try:
        trainer.train()
    except run_lock.RunLockLost as error:
        print(f"LOCK LOST: {error}", flush=True)
        return 3
    except run_lock.RunLocked as error:
        print(f"REFUSED: {error}", flush=True)
        return 4
    print(f"DONE in {trainer.args.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
