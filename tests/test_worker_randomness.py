"""Resume is bitwise with DataLoader workers: persistent workers at an epoch boundary, and random
augmentation drawn from ``framework.sample_generator(index)`` at any step, with num_workers=2."""

import os
import random

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from toy import ToyModule, flat_parameters

import framework
from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.data.sample_randomness import LoaderSeeding, derive_seed, sample_seed

N_TRAIN, BATCH = 64, 8  # 8 steps per epoch


class Augmented(Dataset):
    """``x`` plus noise: none, from ``sample_generator(index)``, or from the worker's global RNG."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: str) -> None:
        self.x, self.y, self.noise = x, y, noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.noise == "helper":
            x = x + 0.3 * torch.randn(x.shape, generator=framework.sample_generator(index))
        elif self.noise == "global":  # the usual way: torch's, numpy's and random's global generators
            shift = float(numpy.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
            x = x + 0.3 * torch.randn(x.shape) + shift
        return x, self.y[index]


class WorkerModule(ToyModule):
    def __init__(self, noise: str = "none", persistent: bool = False) -> None:
        super().__init__(n_train=N_TRAIN, val_loaders=0, dropout=0.2, scheduler=None)
        self.data = Augmented(*self.train_ds.tensors, noise=noise)
        self.persistent = persistent

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(
            self.data, batch_size=batch_size, sampler=sampler(self.data), num_workers=2, persistent_workers=self.persistent
        )


def run(tmp_path, name, noise="none", persistent=False, save_at_end=True, **overrides):
    saving = DefaultCheckpointerArguments(
        save_dir=str(tmp_path / name / "ckpt"), period=0, save_at_end=save_at_end, resume="auto"
    )
    values = dict(
        epochs=3,
        train_batch_size=BATCH,
        seed=5,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=str(tmp_path / name),
        checkpointer_args=saving,
    )
    values.update(overrides)
    module = WorkerModule(noise, persistent)
    trainer = Trainer(module, TrainerArguments(**values))
    trainer.train()
    # Stop persistent workers now: a trainer freed later by the cyclic garbage collector makes
    # DataLoader's shutdown wait 5 s per worker (its workers never get the stop message).
    iterator = getattr(trainer.train_loader.loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
    return flat_parameters(module)


def test_persistent_workers_resume_at_an_epoch_boundary_bitwise(tmp_path):
    reference = run(tmp_path, "reference", persistent=True, save_at_end=False)
    run(tmp_path, "resumed", persistent=True, epochs=1)
    assert os.listdir(tmp_path / "resumed" / "ckpt") == ["checkpoint-000000008.pt"]
    assert torch.equal(run(tmp_path, "resumed", persistent=True), reference)


@pytest.mark.parametrize("persistent", [False, True])
def test_augmentation_from_sample_generator_resumes_mid_epoch_bitwise(tmp_path, persistent, framework_log):
    reference = run(tmp_path, "reference", "helper", persistent)
    assert not any("sample_generator(index)" in line for line in framework_log)  # a map-style dataset: exact
    run(tmp_path, "resumed", "helper", persistent, max_steps=11)  # 3 steps into epoch 2
    assert torch.equal(run(tmp_path, "resumed", "helper", persistent), reference)
    assert not torch.equal(run(tmp_path, "other_seed", "helper", persistent, seed=6), reference)


@pytest.mark.parametrize("persistent", [False, True])
def test_global_rng_augmentation_resumes_mid_epoch_bitwise(tmp_path, persistent):
    """torch.randn, numpy.random and random in __getitem__, in 2 workers: seeded per sample from (seed, epoch, index)."""
    reference = run(tmp_path, "reference", "global", persistent)
    run(tmp_path, "resumed", "global", persistent, max_steps=11)  # 3 steps into epoch 2
    assert torch.equal(run(tmp_path, "resumed", "global", persistent), reference)
    assert not torch.equal(run(tmp_path, "other_seed", "global", persistent, seed=6), reference)


def test_global_rng_augmentation_resumes_at_an_epoch_boundary_without_persistent_workers(tmp_path):
    # Worker seeds come from (seed, epoch), not from the global RNG: an epoch-boundary resume repeats them.
    reference = run(tmp_path, "reference", "global", save_at_end=False)
    run(tmp_path, "resumed", "global", epochs=2)
    assert torch.equal(run(tmp_path, "resumed", "global"), reference)


def test_sample_seeds_follow_seed_epoch_and_index():
    loader = DataLoader(list(range(4)))
    seeding = LoaderSeeding(loader, seed=42)
    seeding.start_epoch(2)
    assert sample_seed(7) == derive_seed(42, 2, 7)
    first = torch.randn(3, generator=framework.sample_generator(7))
    assert torch.equal(first, torch.randn(3, generator=framework.sample_generator(7)))
    assert not torch.equal(first, torch.randn(3, generator=framework.sample_generator(8)))
    seeding.start_epoch(3)
    assert not torch.equal(first, torch.randn(3, generator=framework.sample_generator(7)))
    assert loader.generator is not None and loader.generator.initial_seed() == derive_seed(42, 3)
    own = torch.Generator().manual_seed(1)
    LoaderSeeding(DataLoader(list(range(4)), generator=own), seed=42).start_epoch(0)  # the user's own is kept
    assert own.initial_seed() == 1
