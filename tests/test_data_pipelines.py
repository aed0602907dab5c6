"""Exact on every data pipeline: batches of any container reach the device, streams are
sharded by rank and worker, loaders that cannot resume mid-epoch get no mid-epoch
checkpoints, ordered samplers resume, and worker randomness survives a resume."""

import collections
import dataclasses
import logging
import os
from typing import Any, Dict, List, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from distributed import run_ranks
from toy import ToyModule, flat_parameters, make_classification

from backends import map_tensors
from backends.batch import move_to_device
from framework import ModuleInterface, Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments


def make_args(out, **overrides) -> TrainerArguments:
    values = dict(
        epochs=1, train_batch_size=8, seed=0, disable_tqdm=True, log_level="WARNING", output_dir=str(out),
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    values.update(overrides)
    return TrainerArguments(**values)


# -- batches of any container ---------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    meta: str = "m"


@dataclasses.dataclass(frozen=True)
class FrozenPair:
    x: torch.Tensor
    nested: List[Any]


class Named(NamedTuple):
    x: torch.Tensor
    y: int


def test_map_tensors_rebuilds_every_common_container():
    to_double = lambda tensor: tensor.double()  # noqa: E731  (a to(dtype)-style move)
    default = collections.defaultdict(list, {"x": torch.ones(2)})
    user = collections.UserDict({"x": torch.ones(2)})
    batch = {
        "pair": Pair(torch.ones(2)),
        "frozen": FrozenPair(torch.ones(2), [torch.ones(1), (torch.ones(1), "s")]),
        "named": Named(torch.ones(2), 3),
        "default": default,
        "user": user,
        "ordered": collections.OrderedDict(x=torch.ones(2)),
        "lists": [[torch.ones(1)], [[torch.ones(1)]]],
    }
    moved = map_tensors(batch, to_double)
    leaves = []
    map_tensors(moved, leaves.append)
    assert len(leaves) == 10 and all(leaf.dtype == torch.float64 for leaf in leaves)
    assert isinstance(moved["pair"], Pair) and moved["pair"].meta == "m"
    assert isinstance(moved["frozen"], FrozenPair) and moved["frozen"].nested[1][1] == "s"
    assert isinstance(moved["named"], Named) and moved["named"].y == 3
    assert isinstance(moved["default"], collections.defaultdict) and moved["default"]["missing"] == []
    assert isinstance(moved["user"], collections.UserDict) and isinstance(moved["ordered"], collections.OrderedDict)
    # The input is untouched.
    assert batch["pair"].x.dtype == torch.float32 and user["x"].dtype == torch.float32 and default["x"].dtype == torch.float32


def test_move_to_device_reaches_every_leaf():
    batch = [Pair(torch.ones(2)), collections.UserDict(x=torch.ones(1)), collections.defaultdict(int, x=torch.ones(1))]
    moved = move_to_device(batch, torch.device("meta"))
    leaves = []
    map_tensors(moved, leaves.append)
    assert [leaf.device.type for leaf in leaves] == ["meta"] * 3


# -- streams ----------------------------------------------------------------------------------


class Stream(IterableDataset):
    """``n`` samples (index, features, label) read in order; no ``__len__`` unless ``sized``."""

    def __init__(self, n: int = 64) -> None:
        self.data = make_classification(n, features=16, classes=4, seed=0)

    def __iter__(self):
        for index in range(len(self.data)):
            x, y = self.data[index]
            yield torch.tensor(index), x, y


class SizedStream(Stream):
    def __len__(self) -> int:
        return len(self.data)


class StreamModule(ToyModule):
    """Trains on a stream; records every sample index it trained on."""

    def __init__(self, stream: IterableDataset, num_workers: int = 0, scheduler=None) -> None:
        super().__init__(val_loaders=0, scheduler=scheduler)
        self.stream = stream
        self.num_workers = num_workers
        self.seen: List[int] = []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.stream, batch_size=batch_size, num_workers=self.num_workers)

    def train_step(self, global_step, batch, device):
        index, x, y = batch
        self.seen.extend(index.tolist())
        return F.cross_entropy(self.net(x), y)


def _stream_rank(rank, out, sized):
    module = StreamModule(SizedStream() if sized else Stream())
    trainer = Trainer(module, make_args(out, backend="ddp", train_batch_size=8))
    trainer.train()
    trainer.close()
    return module.seen, trainer.global_steps_finished


@pytest.mark.parametrize("sized", [False, True])
def test_two_ranks_train_on_distinct_shards_of_a_stream(tmp_path, sized):
    (seen0, steps0), (seen1, steps1) = run_ranks(_stream_rank, out=str(tmp_path), sized=sized)
    assert seen0 == list(range(0, 64, 2)) and seen1 == list(range(1, 64, 2))  # every world_size-th item
    assert steps0 == steps1 == 8  # 32 samples per rank, 4 per rank per step


def test_loader_workers_read_distinct_shards_of_a_stream(tmp_path):
    module = StreamModule(Stream(), num_workers=2)
    Trainer(module, make_args(tmp_path, train_batch_size=8)).train()
    assert sorted(module.seen) == list(range(64))  # each sample once, though two workers read the stream


def test_a_stream_that_shards_itself_is_left_alone(tmp_path):
    stream = Stream()
    stream.shards_itself = True
    module = StreamModule(stream, num_workers=2)
    Trainer(module, make_args(tmp_path, train_batch_size=8)).train()
    assert sorted(module.seen) == sorted(list(range(64)) * 2)  # it said it shards itself: it did not


def test_a_schedule_needing_the_epoch_length_of_a_stream_names_the_setting(tmp_path):
    module = StreamModule(Stream(), scheduler="onecycle")
    with pytest.raises(TypeError, match=r"estimated_global_steps_per_epoch=None .*max_train_steps_per_epoch"):
        Trainer(module, make_args(tmp_path)).train()
    assert module.seen == []  # before step 1
    # With the setting, the schedule is built from it.
    module = StreamModule(Stream(), scheduler="onecycle")
    Trainer(module, make_args(tmp_path, max_train_steps_per_epoch=8)).train()
    assert module.calls["estimated_steps"] == 8 and len(module.seen) == 64


def test_the_progress_bar_counts_steps_of_a_stream(tmp_path, capsys):
    from framework.callbacks.progress import ProgressBar

    Trainer(StreamModule(Stream()), make_args(tmp_path, disable_tqdm=False), callbacks=[ProgressBar(refresh_seconds=0)]).train()
    drawn = capsys.readouterr().err.replace(" ", "")
    assert "epoch1/1:8step[" in drawn and "/" not in drawn.split("epoch1/1:")[-1].split("step")[0]  # no total
