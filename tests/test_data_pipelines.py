"""Exact on every data pipeline: batches of any container reach the device, streams are
sharded by rank and worker, loaders that cannot resume mid-epoch get no mid-epoch
checkpoints, ordered samplers resume, and worker randomness survives a resume."""

import collections
import dataclasses
import functools
import os
from typing import Any, Dict, List, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from distributed import run_ranks
from toy import ToyModule, flat_parameters, make_classification, toy_args

from backends import map_tensors
from backends.data.batch import move_to_device
from framework import Trainer
from framework.checkpoint.arguments import DefaultCheckpointerArguments

make_args = functools.partial(toy_args, train_batch_size=8)


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


@pytest.mark.slow
@pytest.mark.distributed
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

    Trainer(
        StreamModule(Stream()), make_args(tmp_path, disable_tqdm=False), callbacks=[ProgressBar(refresh_seconds=0, style="bar")]
    ).train()
    drawn = capsys.readouterr().err.replace(" ", "")
    assert "epoch1/1:8step[" in drawn and "/" not in drawn.split("epoch1/1:")[-1].split("step")[0]  # no total


# -- no checkpoint that cannot be resumed ---------------------------------------------------


class OwnRandomSampler(ToyModule):
    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=torch.utils.data.RandomSampler(self.train_ds))


def checkpoints_in(directory) -> List[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("checkpoint-"))


def test_a_loader_that_cannot_resume_mid_epoch_is_saved_only_at_epoch_ends(tmp_path, framework_log):
    saving = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), save_every_n_steps=3, period=1, resume="auto")
    trainer = Trainer(
        OwnRandomSampler(scheduler=None), make_args(tmp_path, epochs=2, train_batch_size=32, checkpointer_args=saving)
    )
    trainer.train()
    said = list(framework_log)
    assert sum("RandomSampler) has no fast_forward(n)" in line and "saved only at epoch ends" in line for line in said) == 1
    assert sum("no checkpoint at step" in line for line in said) == 1 and "no checkpoint at step 3 (mid-epoch)" in "".join(said)
    assert checkpoints_in(tmp_path / "ckpt") == ["checkpoint-000000008.pt", "checkpoint-000000016.pt"]
    # Every checkpoint it wrote resumes: a longer run continues from the last one.
    longer = Trainer(
        OwnRandomSampler(scheduler=None), make_args(tmp_path, epochs=3, train_batch_size=32, checkpointer_args=saving)
    )
    longer.train()
    assert longer.global_steps_finished == 24


def test_a_stream_without_state_is_saved_only_at_epoch_ends(tmp_path):
    saving = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), save_every_n_steps=3, period=1)
    Trainer(StreamModule(Stream()), make_args(tmp_path, epochs=2, checkpointer_args=saving)).train()
    assert checkpoints_in(tmp_path / "ckpt") == ["checkpoint-000000008.pt", "checkpoint-000000016.pt"]  # not 3, 6, 9, ...


class StatefulStream(Stream):
    """A stream that knows how far it has been read (the dataset state protocol)."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 0

    def __iter__(self):
        while self.position < len(self.data):
            index = self.position
            self.position += 1
            x, y = self.data[index]
            yield torch.tensor(index), x, y
        self.position = 0  # the next epoch starts over

    def state_dict(self) -> Dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.position = state["position"]


def test_a_stream_with_state_resumes_mid_epoch_exactly(tmp_path):
    def run(out, max_steps=None, **checkpointer):
        module = StreamModule(StatefulStream())
        module.net[2].p = 0.2  # dropout: RNG states matter too
        saving = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=0, **checkpointer)
        trainer = Trainer(module, make_args(tmp_path / out, epochs=2, max_steps=max_steps, checkpointer_args=saving))
        trainer.train()
        return module, trainer

    reference, _ = run("reference", save_at_end=False)
    _stopped, _ = run("stopped", max_steps=11, save_at_end=True)  # 8 steps per epoch: stops mid-epoch 2
    assert checkpoints_in(tmp_path / "ckpt") == ["checkpoint-000000011.pt"]
    resumed, trainer = run("stopped", resume="auto", save_at_end=False)  # the same run, continued
    assert trainer.global_steps_finished == 16
    assert resumed.seen == list(range(24, 64))  # the rest of epoch 2, nothing twice
    assert torch.equal(flat_parameters(resumed), flat_parameters(reference))


# -- ordered data ---------------------------------------------------------------------------


class Ordered(ToyModule):
    """Trains on ``sampler(dataset, shuffle=False)``; records the sample indices per epoch and
    whether each epoch began as a resumed one."""

    def __init__(self) -> None:
        super().__init__(n_train=64, val_loaders=0, scheduler=None)
        x, y = self.train_ds.tensors
        self.indexed = TensorDataset(torch.arange(64), x, y)
        self.seen: Dict[int, List[int]] = {}
        self.began: List[Any] = []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.indexed, batch_size=batch_size, sampler=sampler(self.indexed, shuffle=False))

    def train_step(self, global_step, batch, device):
        index, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return F.cross_entropy(self.net(x), y)

    def on_begin_train_epoch(self, global_step, epoch):
        self.began.append((epoch, self.trainer.epoch_resumed))


def test_an_ordered_sampler_keeps_dataset_order_and_resumes_mid_epoch(tmp_path):
    saving = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), period=0, save_at_end=True, resume="auto")
    first = Ordered()
    Trainer(first, make_args(tmp_path, epochs=2, max_steps=11, checkpointer_args=saving)).train()
    assert first.seen == {0: list(range(64)), 1: list(range(24))}  # 8 per step, in dataset order every epoch
    resumed = Ordered()
    Trainer(resumed, make_args(tmp_path, epochs=3, checkpointer_args=saving)).train()
    assert resumed.seen == {1: list(range(24, 64)), 2: list(range(64))}
    assert resumed.began == [(1, True), (2, False)]


def test_a_bad_shuffle_argument_is_refused(tmp_path):
    class Bad(Ordered):
        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(self.indexed, sampler=sampler(self.indexed, shuffle="no"))

    with pytest.raises(TypeError, match=r"sampler\(dataset, shuffle='no'\): allowed: True, False or None"):
        Trainer(Bad(), make_args(tmp_path)).train()


def _ordered_rank(rank, out):
    module = Ordered()
    Trainer(module, make_args(out, backend="ddp", epochs=2)).train()
    module.trainer.close()
    return module.seen


@pytest.mark.distributed
def test_an_ordered_sampler_keeps_each_ranks_share_in_order(tmp_path):
    seen0, seen1 = run_ranks(_ordered_rank, out=str(tmp_path))
    assert seen0 == {0: list(range(0, 64, 2)), 1: list(range(0, 64, 2))}
    assert seen1 == {0: list(range(1, 64, 2)), 1: list(range(1, 64, 2))}


# -- resume at every coincidence of save and validation points ------------------------------


def _coinciding_run(out, checkpointer):
    module = ToyModule(n_train=64, n_val=16, dropout=0.1, scheduler="step")
    args = make_args(
        out,
        epochs=2,
        train_batch_size=8,
        val_every_n_steps=3,
        val_every_n_epochs=1,
        log_every_n_steps=2,
        checkpointer_args=checkpointer,
    )
    trainer = Trainer(module, args)
    history = trainer.train()
    return flat_parameters(module), history.records


def test_resume_from_every_step_where_saves_and_validations_coincide_and_interleave(tmp_path):
    # 8 steps per epoch; validation every 3 steps and at epoch ends (steps 3, 6, 8, 9, 12, 15, 16);
    # a checkpoint after every step, and one at each epoch end.
    every_step = DefaultCheckpointerArguments(save_dir=str(tmp_path / "ckpt"), save_every_n_steps=1, period=1, save_at_end=False)
    reference, records = _coinciding_run(tmp_path / "reference", every_step)
    validated = [record["step"] for record in records if record["name"] == "val_loss"]
    assert validated == [3, 6, 8, 9, 12, 15, 16]  # each step validated once, the epoch end included
    for checkpoint in checkpoints_in(tmp_path / "ckpt"):
        resume = DefaultCheckpointerArguments(load_filename=str(tmp_path / "ckpt" / checkpoint), period=0, save_at_end=False)
        parameters, resumed_records = _coinciding_run(tmp_path / checkpoint, resume)
        assert torch.equal(parameters, reference), checkpoint
        assert resumed_records == records, checkpoint


# -- what a multi-rank stream loses per epoch, said once ---------------------------------------


class ReplayStream(torch.utils.data.IterableDataset):
    """A per-rank stream (each rank samples its own replay buffer)."""

    def __init__(self, count: int, shards_itself: bool = False) -> None:
        self.count, self.shards_itself = count, shards_itself

    def __iter__(self):
        return iter(range(self.count))

    def __len__(self) -> int:
        return self.count


def test_a_stream_split_by_rank_is_named_with_the_items_it_discards():
    from backends.data.streams import shard_stream
    from framework.data.loader_plan import stream_share_problem

    loader = shard_stream(torch.utils.data.DataLoader(ReplayStream(40), batch_size=4), rank=0, world_size=2)
    problem = stream_share_problem(loader, [len(loader), len(loader)], [40, 40])
    assert problem.startswith("the train stream ReplayStream does not declare shards_itself = True")
    assert "(40 of 80 items per epoch over the ranks)" in problem and "ShardedStream" not in problem


def test_uneven_per_rank_streams_say_how_many_batches_are_dropped_per_epoch():
    from framework.data.loader_plan import stream_share_problem

    loader = torch.utils.data.DataLoader(ReplayStream(40, shards_itself=True), batch_size=4)
    problem = stream_share_problem(loader, [10, 13], [40, 52])
    assert problem == (
        "the ranks' ReplayStream streams have [10, 13] batches per epoch and every rank stops with the shortest, so "
        "3 batches (3 x 4 items) are dropped every epoch (rank 1: 3)"
    )
    assert stream_share_problem(loader, [10, 10], [40, 40]) is None
    assert "no __len__" in stream_share_problem(loader, [None, None], [None, None])


def test_the_sampler_state_is_its_position_and_an_epoch_end_state_does_not_replay_its_epoch():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from backends.data.samplers import ResumableSampler

    data = TensorDataset(torch.arange(20))
    loader = StatefulDataLoader(data, batch_size=4, sampler=ResumableSampler(data, shuffle=True, seed=3, rank=1, world_size=2))
    loader.sampler.set_epoch(2)
    whole = [batch[0].tolist() for batch in loader]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert loader.sampler.state_dict() == {"epoch": 2, "skip": 4}  # one batch of 4 handed out
    resumed = StatefulDataLoader(data, batch_size=4, sampler=ResumableSampler(data, shuffle=True, seed=3, rank=1, world_size=2))
    resumed.sampler.set_epoch(2)
    resumed.load_state_dict(state)
    assert [batch[0].tolist() for batch in resumed] == whole[1:]  # the next batch, not the epoch's first

    ended = loader.state_dict()  # after a whole epoch 2
    next_epoch = StatefulDataLoader(
        data, batch_size=4, sampler=ResumableSampler(data, shuffle=True, seed=3, rank=1, world_size=2)
    )
    next_epoch.sampler.set_epoch(3)
    next_epoch.load_state_dict(ended)
    third = [batch[0].tolist() for batch in next_epoch]
    epoch_three = ResumableSampler(data, shuffle=True, seed=3, rank=1, world_size=2)
    epoch_three.set_epoch(3)
    assert [i for batch in third for i in batch] == list(epoch_three) != [i for batch in whole for i in batch]
