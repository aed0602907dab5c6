"""A pipeline run (fsdp, ``pipeline_parallel_size=2``) that SIGKILLs one of its ranks once, at a chosen step.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 tests/pipeline_resume_script.py OUT --kill STEP@RANK

Checkpoints every step into ``OUT/checkpoints`` and resumes from them (``resume="auto"``); the kill
happens once (a marker file under ``OUT``), after the optimizer step ``STEP`` was saved and one more
micro-batch ran. Each rank writes its stage's weights and the history to ``OUT/result-<rank>.pt``.
"""

import argparse
import os
import signal
import sys
from typing import Any, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_llama import PipelineLlama, full_weights

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback
from framework.checkpoint import DefaultCheckpointerArguments


class Killer(Callback):
    """SIGKILLs this process in the first micro-batch after step ``step`` (once: a marker file)."""

    def __init__(self, out: str, step: Optional[int], rank: Optional[int]) -> None:
        self.out, self.step, self.rank = out, step, rank

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        marker = os.path.join(self.out, "killed")
        if self.step is None or global_step != self.step or int(os.environ["RANK"]) != self.rank or os.path.exists(marker):
            return
        with open(marker, "w") as file:
            file.write(str(global_step))
        print(f"KILLING at step {global_step} on rank {self.rank}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", default=None, help="STEP@RANK")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    step, rank = (int(part) for part in options.kill.split("@")) if options.kill else (None, None)
    checkpoints = DefaultCheckpointerArguments(
        save_dir=os.path.join(options.out, "checkpoints"), save_every_n_steps=1, period=0, resume="auto", keep_last_n=2
    )
    args = TrainerArguments(
        backend="fsdp",
        pipeline_parallel_size=2,
        train_batch_size=8,
        gpu_batch_size_limit=2,
        max_steps=5,
        clip_grads=True,
        max_grad_norm=0.3,
        log_every_n_steps=1,
        disable_tqdm=True,
        log_level="INFO",
        sanity_val_steps=0,
        loggers=[],
        output_dir=os.path.join(options.out, "run"),
        checkpointer_args=checkpoints,
        seed=3,
    )
    module = PipelineLlama()
    trainer = Trainer(module, args, callbacks=[Killer(options.out, step, rank)])
    history = trainer.train()
    torch.save(
        {"weights": full_weights(module), "history": history.records, "step": trainer.global_steps_finished},
        os.path.join(options.out, f"result-{os.environ['RANK']}.pt"),
    )


if __name__ == "__main__":
    main()
