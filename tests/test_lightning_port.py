"""A Lightning program ported as it is written: a torchmetrics ``Accuracy`` logged as an object
(``self.log("val_acc", self.val_acc, prog_bar=True, sync_dist=True)``), a bare
``ReduceLROnPlateau``, checkpoints keeping the best 2 only (``save_top_k=2``: ``keep_last_n=0``)
and ``EarlyStopping``. Its epoch metrics equal a hand-written PyTorch loop on ``sp`` and on
2-rank ``ddp``; the learning rate was cut and the run stopped early, as in the reference."""

import copy
import os
import re
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from logs import captured_log
from torch.utils.data import DataLoader, TensorDataset

from distributed import run_ranks

from framework import ModuleInterface, Trainer, TrainerArguments, seed_everything
from framework.callbacks import EarlyStopping, ProgressBar
from framework.checkpoint import DefaultCheckpointerArguments
from framework.metrics.collector import MetricCollector

EPOCHS, LR, PATIENCE = 12, 2.0, 2  # chosen so that the LR is cut three times and the run stops at epoch 6 of 12


def blobs():
    """64 training and 40 validation points of 3 noisy classes (one full batch per epoch)."""
    generator = torch.Generator().manual_seed(3)
    centers = torch.randn(3, 8, generator=generator)

    def draw(count):
        labels = torch.arange(count) % 3
        return centers[labels] + torch.randn(count, 8, generator=generator) * 1.3, labels

    return draw(64), draw(40)


class LitClassifier(ModuleInterface):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        (train_x, train_y), (val_x, val_y) = blobs()
        self.train_ds, self.val_ds = TensorDataset(train_x, train_y), TensorDataset(val_x, val_y)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=LR)
        return [optimizer], [torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)]

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def train_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)  # forward: the batch's value, and the epoch's state
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return F.cross_entropy(logits, y)

    def val_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True, sync_dist=True)
        return F.cross_entropy(logits, y, reduction="none")


def reference(net: torch.nn.Module) -> Dict[str, List[float]]:
    """The same training by hand: full-batch SGD, ReduceLROnPlateau on val_loss, early stopping on val_acc."""
    (train_x, train_y), (val_x, val_y) = blobs()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    metrics: Dict[str, List[float]] = {"train_loss_epoch": [], "train_acc_epoch": [], "val_loss": [], "val_acc": [], "lr": []}
    best, wait = -1.0, 0
    for _ in range(EPOCHS):
        logits = net(train_x)
        loss = F.cross_entropy(logits, train_y)
        metrics["train_loss_epoch"].append(loss.item())
        metrics["train_acc_epoch"].append((logits.argmax(1) == train_y).float().mean().item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            val_logits = net(val_x)
            val_loss = F.cross_entropy(val_logits, val_y).item()
            val_acc = (val_logits.argmax(1) == val_y).float().mean().item()
        metrics["val_loss"].append(val_loss)
        metrics["val_acc"].append(val_acc)
        plateau.step(val_loss)
        metrics["lr"].append(optimizer.param_groups[0]["lr"])
        best, wait = (val_acc, 0) if val_acc > best else (best, wait + 1)
        if wait >= PATIENCE:
            break
    return metrics


def port(rank: int, tmp: str, backend: str) -> Dict[str, Any]:
    seed_everything(0)
    module = LitClassifier()
    start = copy.deepcopy(module.net)
    checkpoints = DefaultCheckpointerArguments(keep_last_n=0, keep_best_n=2, metric="val_acc", mode="max", save_at_end=False)
    args = TrainerArguments(
        epochs=EPOCHS,
        train_batch_size=64,
        val_batch_size=8,
        log_every_n_steps=1,
        backend=backend,
        seed=0,
        output_dir=os.path.join(tmp, backend),
        log_level="INFO",
        disable_tqdm=False,
        model_summary=False,
        checkpointer_args=checkpoints,
    )
    callbacks = [EarlyStopping(monitor="val_acc", mode="max", patience=PATIENCE), ProgressBar(refresh_seconds=0, style="lines")]
    trainer = Trainer(module, args, callbacks=callbacks)
    with captured_log("framework.callbacks.progress") as lines:
        history = trainer.train()
    kept = sorted(name for name in os.listdir(os.path.join(args.output_dir, "checkpoints")) if name.endswith(".pt"))
    names = ["train_loss_epoch", "train_acc_epoch", "train_acc", "val_loss", "val_acc"]
    return {
        "history": {name: history.values(name) for name in names},
        "kept_steps": [int(re.search(r"(\d+)", name).group(1)) for name in kept],
        "val_acc_steps": dict(history.steps("val_acc")),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "metric_state_after": int(module.val_acc.tp.sum() + module.val_acc.fn.sum()),
        "lines": list(lines),
        "reference": reference(start) if rank == 0 else None,
    }


def check_against_the_reference(result: Dict[str, Any]) -> None:
    expected, history = result["reference"], result["history"]
    epochs = len(expected["val_acc"])
    assert epochs == 6 < EPOCHS  # early stopping ended it where the reference stopped
    assert history["train_acc_epoch"] == expected["train_acc_epoch"]  # compute() over every sample and rank
    assert history["val_acc"] == expected["val_acc"]
    assert history["train_acc"] == expected["train_acc_epoch"]  # on_step: the batch's forward value (one batch)
    for name in ("train_loss_epoch", "val_loss"):  # means of batch means over ranks: equal up to rounding
        assert history[name] == pytest.approx(expected[name], rel=1e-6), name
    assert result["lr"] == expected["lr"][-1] == LR / 8  # ReduceLROnPlateau cut it three times
    best_two = sorted(expected["val_acc"], reverse=True)[:2]
    assert len(result["kept_steps"]) == 2  # save_top_k=2: no newest checkpoint beside the best two
    assert sorted((result["val_acc_steps"][step] for step in result["kept_steps"]), reverse=True) == best_two
    assert result["metric_state_after"] == 0  # reset() after the epoch's compute()


def test_the_lightning_program_matches_the_reference_on_sp(tmp_path):
    result = port(rank=0, tmp=str(tmp_path), backend="sp")
    check_against_the_reference(result)
    # prog_bar values and the whole run's ETA are on the progress lines
    last = result["lines"][-1]
    assert re.search(r"train_acc \d\.\d{4}", last) and re.search(r"val_acc \d\.\d{4}", last), last
    assert re.search(r"run ETA \d\d:\d\d", last), last


@pytest.mark.distributed
@pytest.mark.slow
def test_the_lightning_program_matches_the_reference_on_two_ddp_ranks(tmp_path):
    results = run_ranks(port, world_size=2, timeout=120, tmp=str(tmp_path), backend="ddp")
    check_against_the_reference(results[0])
    assert results[1]["history"] == results[0]["history"]  # every rank recorded the same values
    assert results[1]["lines"] == []  # progress on rank zero only


def test_a_metric_object_needs_one_number_and_one_object_per_name():
    collector = MetricCollector()
    first, second = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
    first.update(torch.tensor([1.0, 2.0]))
    collector.log("mean", first)
    with pytest.raises(ValueError, match="logged with another Metric object"):
        collector.log("mean", second)
    collector.log("plain", torch.tensor(1.0))
    with pytest.raises(ValueError, match="logged with plain values"):
        collector.log("plain", first)
    assert {name: float(logged.value) for name, logged in collector.pop_epoch().items()} == {"mean": 1.5, "plain": 1.0}
    assert float(first.mean_value) == 0.0 and float(first.weight) == 0.0  # reset() after compute()
    per_class = torchmetrics.Accuracy(task="multiclass", num_classes=3, average=None)
    per_class.update(torch.tensor([0, 1]), torch.tensor([0, 2]))
    collector.log("per_class", per_class)
    with pytest.raises(ValueError, match=r"compute\(\) must give one number"):
        collector.pop_epoch()


def test_save_top_k_semantics_need_a_best_count():
    assert DefaultCheckpointerArguments(keep_last_n=0, keep_best_n=2).keep_last_n == 0
    with pytest.raises(ValueError, match="keep_last_n=0 with keep_best_n=0 would delete every checkpoint"):
        DefaultCheckpointerArguments(keep_last_n=0)
    with pytest.raises(ValueError, match=r"keep_last_n=-1 is invalid; allowed: None or an integer >= 0"):
        DefaultCheckpointerArguments(keep_last_n=-1)
