"""Evaluation metrics are exact: means weighted by batch size, equal on one process and on 2
gloo ranks, float64 kept, dict outputs in the same shape, and a rank without batches joins."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from distributed import run_ranks
from toy import toy_args

from framework import ModuleInterface, Trainer


class Scored(ModuleInterface):
    """A fixed linear classifier on ``n_val`` samples; logs accuracy, returns a scalar loss."""

    def __init__(self, n_val: int = 33, dtype: torch.dtype = torch.float32, returns: str = "scalar") -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.net = torch.nn.Linear(5, 3).to(dtype)
        with torch.no_grad():
            self.net.weight.copy_(torch.randn(3, 5, generator=generator))
            self.net.bias.copy_(torch.randn(3, generator=generator))
        self.val_ds = TensorDataset(
            torch.randn(n_val, 5, generator=generator).to(dtype), torch.randint(0, 3, (n_val,), generator=generator)
        )
        self.returns = returns
        self.seen = None

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def get_val_dataloaders(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def val_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        correct = (logits.argmax(1) == y).to(logits.dtype)
        self.log("acc", correct.mean())  # a batch mean: weighted by the batch's size
        self.log("acc_given", correct.mean(), batch_size=len(y))
        self.log("tiny", torch.tensor(1 + 1e-12, dtype=torch.float64))  # float32 would make it 1.0
        loss = F.cross_entropy(logits, y)
        if self.returns == "dict":
            return {"loss": loss, "correct": correct, "x": {"first": x[:, 0]}}
        return loss

    def on_end_val_epoch(self, global_step, *outputs, key=""):
        self.seen = outputs

    def truth(self):
        x, y = self.val_ds.tensors
        with torch.no_grad():
            logits = self.net(x)
        return {"acc": (logits.argmax(1) == y).double().mean().item(), "loss": F.cross_entropy(logits.double(), y).item()}


make_args = functools.partial(toy_args, train_batch_size=16, val_batch_size=8, log_level="ERROR", ddp_timeout=30)


def _validate(out, backend="sp", rank=0, **module_args):
    module = Scored(**module_args)
    trainer = Trainer(module, make_args(out, backend=backend))
    metrics = trainer.validate()
    trainer.close()
    return metrics, module.truth(), module.seen


def test_epoch_means_are_weighted_by_batch_size_on_one_process(tmp_path):
    metrics, truth, _ = _validate(str(tmp_path))  # 33 samples: batches of 8, 8, 8, 8, 1
    assert metrics["acc"] == pytest.approx(truth["acc"], abs=1e-7)
    assert metrics["acc_given"] == pytest.approx(truth["acc"], abs=1e-7)
    assert metrics["val_loss"] == pytest.approx(truth["loss"], rel=1e-6)  # a scalar loss per batch, weighted
    assert metrics["tiny"] == 1 + 1e-12  # float64 stays float64


def test_float64_model_metrics_stay_float64(tmp_path):
    metrics, truth, _ = _validate(str(tmp_path), dtype=torch.float64)
    assert metrics["val_loss"] == pytest.approx(truth["loss"], rel=1e-12)
    assert metrics["acc"] == pytest.approx(truth["acc"], rel=1e-12)


def _two_ranks(rank, out, **module_args):
    metrics, truth, seen = _validate(out, "ddp", **module_args)
    return metrics, truth, seen


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_give_the_metrics_and_outputs_of_one_process(tmp_path):
    single, truth, single_seen = _validate(str(tmp_path / "sp"), returns="dict")
    per_rank = run_ranks(_two_ranks, out=str(tmp_path / "ddp"), returns="dict")
    for metrics, _, seen in per_rank:
        assert metrics.keys() == single.keys()
        for name in single:
            assert metrics[name] == pytest.approx(single[name], abs=1e-6), name
        # A dict from val_step reaches the hook in the same shape, in dataset order.
        loss, rest = seen
        assert isinstance(rest, dict) and rest.keys() == single_seen[1].keys() == {"correct", "x"}
        assert torch.equal(rest["correct"], single_seen[1]["correct"]) and len(rest["correct"]) == 33
        assert torch.equal(rest["x"]["first"], single_seen[1]["x"]["first"])
        assert loss.shape == single_seen[0].shape
    assert single["acc"] == pytest.approx(truth["acc"], abs=1e-7)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_without_validation_batches_does_not_hang(tmp_path):
    # One sample on two ranks: rank 1 runs no val_step and logs nothing.
    per_rank = run_ranks(_two_ranks, timeout=60, out=str(tmp_path), n_val=1)
    single, truth, _ = _validate(str(tmp_path / "sp"), n_val=1)
    for metrics, _, _ in per_rank:
        assert metrics == pytest.approx(single)
        assert metrics["acc"] == truth["acc"]
