"""Batches on a GPU: every container the backend promises to move reaches the device (and trains
as on the CPU), pinned batches are copied asynchronously, and a ``pin_memory`` loader trains as a
pageable one. The CPU counterpart is ``test_data_pipelines.py``."""

import collections
import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cuda_support import CUDA_TIER, cpu_args, cuda_args
from toy import ToyModule, flat_parameters

from backends.data.batch import map_tensors, move_to_device
from framework import Trainer

pytestmark = CUDA_TIER


@dataclasses.dataclass
class Features:
    x: torch.Tensor
    meta: str = "m"


@dataclasses.dataclass(frozen=True)
class Frozen:
    weights: torch.Tensor


class Targets(NamedTuple):
    y: torch.Tensor
    classes: int


def nested_batch(samples):
    """Every container at once: a dict of a dataclass, a frozen one, a namedtuple, a list holding an
    OrderedDict, a tuple of a defaultdict and a UserDict, and non-tensor leaves."""
    x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    return {
        "inputs": Features(x),
        "frozen": Frozen(torch.ones(len(samples))),
        "targets": Targets(y, 4),
        "extra": [collections.OrderedDict(x=x), (collections.defaultdict(list, y=y), collections.UserDict(w=torch.ones(1)))],
        "name": "batch",
    }


class NestedBatches(ToyModule):
    """Trains on ``nested_batch`` batches and records where every tensor of them is."""

    def __init__(self) -> None:
        super().__init__()
        self.devices, self.kinds = set(), set()

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds), collate_fn=nested_batch)

    def train_step(self, global_step, batch, device):
        map_tensors(batch, lambda tensor: self.devices.add(tensor.device.type))
        extra = batch["extra"]
        self.kinds = {
            type(batch["inputs"]).__name__,
            type(batch["frozen"]).__name__,
            type(batch["targets"]).__name__,
            type(extra[0]).__name__,
            type(extra[1][0]).__name__,
            type(extra[1][1]).__name__,
        }
        assert batch["name"] == "batch" and batch["inputs"].meta == "m" and batch["targets"].classes == 4
        assert extra[1][0]["missing"] == []  # the defaultdict keeps its factory
        weights = batch["frozen"].weights
        return (F.cross_entropy(self.net(batch["inputs"].x), batch["targets"].y, reduction="none") * weights).mean()


def test_every_batch_container_reaches_the_gpu_and_trains_as_on_the_cpu(tmp_path):
    gpu_module = NestedBatches()
    gpu = Trainer(gpu_module, cuda_args(tmp_path / "gpu", epochs=2))
    gpu.train()
    cpu = Trainer(NestedBatches(), cpu_args(tmp_path / "cpu", epochs=2))
    cpu.train()
    assert gpu_module.devices == {"cuda"}
    assert gpu_module.kinds == {"Features", "Frozen", "Targets", "OrderedDict", "defaultdict", "UserDict"}
    torch.testing.assert_close(flat_parameters(gpu.module), flat_parameters(cpu.module), rtol=1e-4, atol=1e-5)


def memcpy_kinds(batch) -> set:
    """The host-to-device copies the profiler sees while ``batch`` is moved to the GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        move_to_device(batch, torch.device("cuda"))
        torch.cuda.synchronize()
    return {event.name.lower() for event in profile.events() if "memcpy htod" in event.name.lower()}


def test_pinned_batches_are_copied_asynchronously_and_exactly():
    x, y = torch.randn(256, 64), torch.arange(256)
    pinned = {"x": x.pin_memory(), "y": (y.pin_memory(),)}
    assert memcpy_kinds(pinned) == {"memcpy htod (pinned -> device)"}
    assert memcpy_kinds({"x": x, "y": (y,)}) == {"memcpy htod (pageable -> device)"}  # the check tells them apart
    large = torch.randn(128, 1024, 1024).pin_memory()  # 512 MiB: the copy lasts milliseconds
    torch.cuda.synchronize()
    moved = move_to_device([large], torch.device("cuda"))
    still_copying = not torch.cuda.current_stream().query()  # the host went on while the device copies
    torch.cuda.synchronize()
    assert still_copying
    assert torch.equal(moved[0].cpu(), large)
    moved = move_to_device(pinned, torch.device("cuda"))
    assert torch.equal(moved["x"].cpu(), x) and torch.equal(moved["y"][0].cpu(), y)


class PinnedLoader(ToyModule):
    def __init__(self, pin: bool) -> None:
        super().__init__()
        self.pin = pin

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds), pin_memory=self.pin)


def test_a_pin_memory_loader_trains_exactly_as_a_pageable_one(tmp_path):
    weights = {}
    for pin in (True, False):
        module = PinnedLoader(pin)
        if pin:
            loader = module.get_train_dataloader(lambda dataset: None, 32)
            assert next(iter(loader))[0].is_pinned()
        trainer = Trainer(module, cuda_args(tmp_path / str(pin), epochs=2))
        trainer.train()
        weights[pin] = flat_parameters(trainer.module)
    assert torch.equal(weights[True], weights[False])
