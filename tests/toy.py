"""Small modules and data shared by the tests (generated, never downloaded)."""

import os
from typing import Any, Dict, Optional, Union

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from framework import ModuleInterface, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments


def make_classification(n: int = 256, features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    """A linearly separable-ish synthetic classification set."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    weights = torch.randn(features, classes, generator=generator)
    y = (x @ weights).argmax(1)
    return TensorDataset(x, y)


class ToyModule(ModuleInterface):
    """A 2-layer MLP classifier on synthetic data.

    Args:
        n_train / n_val: dataset sizes.
        dropout: > 0 makes RNG state matter for exact resume.
        lr: SGD-with-momentum learning rate.
        scheduler: "onecycle", "step" or None.
        val_loaders: number of named validation loaders (0: no validation, 1: a single loader).
    """

    def __init__(
        self,
        n_train: int = 256,
        n_val: int = 64,
        features: int = 16,
        hidden: int = 32,
        classes: int = 4,
        dropout: float = 0.0,
        lr: float = 0.05,
        scheduler: Optional[str] = "onecycle",
        val_loaders: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, classes)
        )
        self.train_ds = make_classification(n_train, features, classes, seed=seed)
        self.val_ds = make_classification(n_val, features, classes, seed=seed + 1)
        self.lr = lr
        self.scheduler_kind = scheduler
        self.val_loader_count = val_loaders
        self.calls: Dict[str, Any] = {"estimated_steps": None, "epochs": None}

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        self.calls["estimated_steps"], self.calls["epochs"] = estimated_global_steps_per_epoch, epochs
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler_kind == "onecycle":
            schedulers = [
                torch.optim.lr_scheduler.OneCycleLR(
                    optimizer, max_lr=self.lr, total_steps=estimated_global_steps_per_epoch * epochs
                )
            ]
        elif self.scheduler_kind == "step":
            schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]
        else:
            schedulers = []
        return [optimizer], schedulers

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler, batch_size):
        if self.val_loader_count == 0:
            return None
        if self.val_loader_count == 1:
            return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))
        return {
            f"set{i}": DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))
            for i in range(self.val_loader_count)
        }

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def val_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits.float(), y, reduction="none"), (logits.argmax(1) == y).float()


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened and concatenated (for comparisons)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in module.parameters()])


def toy_args(
    directory: Union[str, "os.PathLike[str]"], checkpoints: Optional[DefaultCheckpointerArguments] = None, **overrides: Any
) -> TrainerArguments:
    """Arguments for a quiet, seeded test run that writes only under ``<directory>/run``.

    Defaults: one epoch, seed 0, no progress bar, warnings only, no sanity validation, and no checkpoints unless
    ``checkpoints`` (or ``checkpointer_args``) is given. Any ``TrainerArguments`` field can be
    overridden. A test file with its own defaults binds them once, e.g.
    ``make_args = functools.partial(toy_args, epochs=2)``.
    """
    values: Dict[str, Any] = dict(
        epochs=1,
        seed=0,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=os.path.join(os.fspath(directory), "run"),
        checkpointer_args=checkpoints or DefaultCheckpointerArguments(period=0, save_at_end=False),
        sanity_val_steps=0,  # tests count val_step calls; tests/test_sanity_check.py covers the check
    )
    values.update(overrides)
    return TrainerArguments(**values)
