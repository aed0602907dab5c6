"""Per-rank state survives a resume on 2 real gloo ranks (``ddp``): the module's own state in
``get_state()`` (an RL replay buffer) and the train dataset's ``state_dict()``, each rank getting
its own back, from a checkpoint taken at an epoch end, from one taken mid-epoch, and from the
previous one when the newest checkpoint file is damaged (skipped with a warning)."""

import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distributed import run_ranks
from toy import ToyModule, make_classification

from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.default import checkpoint_name

STEPS_PER_EPOCH = 4  # 128 samples, global batch 32


class CountingDataset(Dataset):
    """A map dataset that remembers which samples this rank read, over every epoch (``state_dict``)."""

    def __init__(self) -> None:
        self.data = make_classification(128)
        self.read: List[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        self.read.append(int(index))
        return self.data[index]

    def state_dict(self) -> Dict[str, Any]:
        return {"read": list(self.read)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.read = list(state["read"])


class ReplayModule(ToyModule):
    """Keeps a per-rank replay buffer in ``get_state()``: each step appends (rank, step)."""

    def __init__(self) -> None:
        super().__init__(n_train=128, scheduler=None)
        self.train_ds = CountingDataset()
        self.buffer: List[int] = []

    def train_step(self, global_step, batch, device):
        self.buffer.append(1000 * self.global_rank + global_step)
        return super().train_step(global_step, batch, device)

    def get_state(self) -> Dict[str, Any]:
        return {**super().get_state(), "buffer": list(self.buffer)}

    def update_state(self, state: Dict[str, Any]) -> None:
        super().update_state(state)
        self.buffer = list(state["buffer"])


def run(out: str, resume: bool, save_every_n_steps: Any = None, epochs: int = 2, **overrides: Any) -> Trainer:
    args = TrainerArguments(
        epochs=epochs,
        train_batch_size=32,
        backend="ddp",
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=out,
        checkpointer_args=DefaultCheckpointerArguments(resume="auto" if resume else None, save_every_n_steps=save_every_n_steps),
        **overrides,
    )
    trainer = Trainer(ReplayModule(), args)
    trainer.train()
    return trainer


def final_state(trainer: Trainer) -> Dict[str, Any]:
    return {"buffer": trainer.module.buffer, "read": trainer.module.train_ds.read}


def per_rank_scenarios(rank: int, out: str) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    results = {"uninterrupted": final_state(run(os.path.join(out, "whole"), resume=False))}
    for name, stop_at in (("epoch_end", STEPS_PER_EPOCH), ("mid_epoch", STEPS_PER_EPOCH + 2)):
        directory = os.path.join(out, name)
        run(directory, resume=False, max_steps=stop_at)
        resumed = run(directory, resume=True)
        results[name] = final_state(resumed)
        results[name + "_step"] = resumed.global_steps_finished
    directory = os.path.join(out, "damaged")
    run(directory, resume=False, save_every_n_steps=1, max_steps=STEPS_PER_EPOCH + 2)
    if rank == 0:
        with open(os.path.join(directory, "checkpoints", checkpoint_name(STEPS_PER_EPOCH + 2)), "r+b") as handle:
            handle.truncate(1000)  # a write cut short
    dist.barrier()
    resumed = run(directory, resume=True)
    results["damaged"], results["damaged_step"] = final_state(resumed), resumed.global_steps_finished
    results["damaged_from"] = resumed.checkpointer.loaded_from
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_gets_its_own_module_and_dataset_state_back_and_damaged_files_are_skipped(tmp_path):
    ranks = run_ranks(per_rank_scenarios, out=str(tmp_path), timeout=240)
    whole = [result["uninterrupted"] for result in ranks]
    assert whole[0]["buffer"] != whole[1]["buffer"] and whole[0]["read"] != whole[1]["read"]  # the ranks differ
    for rank, result in enumerate(ranks):
        assert result["damaged_from"].endswith(checkpoint_name(STEPS_PER_EPOCH + 1))  # the truncated newest was skipped
        for name in ("epoch_end", "mid_epoch", "damaged"):
            assert result[name + "_step"] == 2 * STEPS_PER_EPOCH
            assert result[name] == whole[rank], (rank, name)
    assert torch.tensor(whole[1]["buffer"]).min() >= 1000  # rank 1 never got rank 0's buffer
    # On one process (another world size), rank 0 takes saved rank 0's state, as the RNG streams do.
    one = run(str(tmp_path / "epoch_end"), resume=True, epochs=3)
    assert one.global_steps_finished == 3 * STEPS_PER_EPOCH
    assert one.module.buffer[: len(whole[0]["buffer"])] == whole[0]["buffer"]
    assert one.module.train_ds.read[: len(whole[0]["read"])] == whole[0]["read"]
