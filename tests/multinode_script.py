"""The one program the many-machines tests launch (tests/test_multinode.py): under ``srun``,
two torchrun agents, or one torchrun on one node.

Each rank prints ``RANK <global> LOCAL <local> NODE <node> WORLD <size> HOST <hostname> LAUNCHER <name>``
as the framework sees it; the run trains the toy MLP (dropout: per-rank RNG matters) for 8
optimizer steps with gradient accumulation, writes a checkpoint every 3 steps and at the end,
and resumes with ``resume="auto"``. ``--signal-at S`` sends SIGUSR1 to every rank after step
``S`` on the job's first attempt (``SLURM_RESTART_COUNT`` unset or 0), as Slurm does before a
preemption: the ranks save, rank 0 requeues the job, and its next attempt resumes.

Example:
    srun -N2 -n2 python tests/multinode_script.py /shared/run --backend ddp
"""

import argparse
import os
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from toy import ToyModule  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402
from framework.checkpoint import DefaultCheckpointerArguments  # noqa: E402


class Report(Callback):
    """Prints what each rank is, and signals itself at the chosen step."""

    def __init__(self, signal_at: int) -> None:
        self.signal_at = signal_at
        self.trainer = None

    def setup(self, trainer) -> None:
        self.trainer = trainer

    def on_begin_train(self, global_step: int) -> None:
        environment = self.trainer.backend.cluster_environment
        print(
            f"RANK {environment.global_rank} LOCAL {environment.local_rank} NODE {environment.node_rank} "
            f"WORLD {environment.world_size} "
            f"HOST {socket.gethostname()} LAUNCHER {environment.name} START {global_step}",
            flush=True,
        )

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step == self.signal_at and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            os.kill(os.getpid(), signal.SIGUSR1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--load-dir", default=None, help="checkpointer_args.load_dir (resume=auto looks in out first)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    args = TrainerArguments(
        epochs=2,
        train_batch_size=16,
        gpu_batch_size_limit=4,
        backend=options.backend,
        disable_tqdm=True,
        output_dir=options.out,
        seed=3,
        log_every_n_steps=2,
        checkpointer_args=DefaultCheckpointerArguments(
            save_every_n_steps=3, keep_last_n=2, resume="auto", load_dir=options.load_dir
        ),
    )
    trainer = Trainer(ToyModule(n_train=64, n_val=16, dropout=0.2, lr=0.1), args, callbacks=[Report(options.signal_at)])
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.is_main_process:
        print(f"FINISHED at step {trainer.global_steps_finished}", flush=True)


if __name__ == "__main__":
    main()
