"""Evaluation and prediction as first-class loops: validate/test/predict load "last", "best" or
a path first (the same file on every rank), predict gives every sample once in dataset order
(in memory on rank zero, or on disk per rank), on sp, sp-amp and 2 gloo ranks."""

import os
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader

from distributed import run_ranks
from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.checkpoint import load_weights
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.evaluation.prediction import load_predictions

N_VAL = 33  # not a multiple of the batch or of the world size


class Predicting(ToyModule):
    """Predicts logits and labels of its validation set; ``returns`` picks the output's shape."""

    def __init__(self, returns: str = "dict", **kwargs) -> None:
        super().__init__(n_train=64, n_val=N_VAL, **kwargs)
        self.returns = returns

    def get_test_dataloaders(self, sampler, batch_size):
        return self.get_val_dataloaders(sampler, batch_size)

    def get_predict_dataloader(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def predict_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        if self.returns == "tuple":
            return logits, y
        return {"logits": logits, "label": y}

    def untrained(self) -> "Predicting":
        """Other weights, same data."""
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.add_(0.5)
        return self

    def expected(self, batch_size: int = 8):
        """The same predictions by hand, batch by batch, in dataset order."""
        x, y = self.val_ds.tensors
        self.eval()
        with torch.no_grad():
            logits = torch.cat([self.net(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
        self.train()
        return {"logits": logits, "label": y}


def make_args(out, backend="sp", **overrides) -> TrainerArguments:
    values = dict(
        epochs=2,
        train_batch_size=16,
        val_batch_size=8,
        seed=0,
        disable_tqdm=True,
        log_level="INFO",
        output_dir=str(out),
        backend=backend,
        ddp_timeout=30,
        checkpointer_args=DefaultCheckpointerArguments(save_dir=str(out / "ckpt"), period=1, save_at_end=False, resume="auto"),
    )
    values.update(overrides)
    return TrainerArguments(**values)


def test_predict_gives_every_sample_once_in_dataset_order(tmp_path):
    module = Predicting()
    trainer = Trainer(module, make_args(tmp_path))
    predictions = trainer.predict()
    expected = module.expected()
    assert predictions.keys() == {"logits", "label"}
    assert torch.equal(predictions["logits"], expected["logits"]) and torch.equal(predictions["label"], expected["label"])
    module.returns = "tuple"
    logits, labels = trainer.predict()
    assert torch.equal(logits, expected["logits"]) and torch.equal(labels, expected["label"])
    assert module.training  # left as it was


def test_predictions_written_per_batch_read_back_in_order(tmp_path):
    module = Predicting()
    trainer = Trainer(module, make_args(tmp_path))
    directory = str(tmp_path / "predictions")
    assert trainer.predict(predictions_dir=directory) == directory
    names = sorted(os.listdir(directory))
    assert names == [f"predictions-rank0-{part:05d}.pt" for part in range(5)]  # 33 samples in batches of 8
    part = torch.load(os.path.join(directory, names[-1]), weights_only=True)
    assert part["indices"].tolist() == [32]
    read = load_predictions(directory)
    assert torch.equal(read["logits"], module.expected()["logits"])
    with pytest.raises(FileExistsError, match="already holds 5 prediction file"):
        trainer.predict(predictions_dir=directory)


def test_default_predict_step_calls_forward_and_a_missing_loader_is_named(tmp_path):
    class Forward(ToyModule):
        def forward(self, x):
            return self.net(x).argmax(1)

        def get_predict_dataloader(self, sampler, batch_size):
            inputs = self.val_ds.tensors[0]
            return DataLoader(inputs, batch_size=batch_size, sampler=sampler(inputs))

    module = Forward(n_val=10)
    predicted = Trainer(module, make_args(tmp_path)).predict()
    with torch.no_grad():
        assert torch.equal(predicted, module.net(module.val_ds.tensors[0]).argmax(1))
    with pytest.raises(NotImplementedError, match=r"ToyModule.get_predict_dataloader\(sampler, batch_size\)"):
        Trainer(ToyModule(), make_args(tmp_path / "none")).predict()
    with pytest.raises(NotImplementedError, match="defines neither predict_step nor forward"):
        ToyModule().predict_step(0, torch.ones(1, 16), torch.device("cpu"))


def test_predict_under_mixed_precision(tmp_path):
    module = Predicting()
    predictions = Trainer(module, make_args(tmp_path, backend="sp-amp")).predict()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected = torch.cat([module.net(module.val_ds.tensors[0][i : i + 8]) for i in range(0, N_VAL, 8)])
    assert predictions["logits"].dtype == expected.dtype and torch.equal(predictions["logits"], expected)


def test_validate_and_test_load_last_best_or_a_path(tmp_path, framework_log):
    trained = Predicting(dropout=0.0)
    trainer = Trainer(trained, make_args(tmp_path, epochs=3))
    trainer.train()
    current = trainer.validate()
    val_losses = trainer.history.steps("val_loss")
    best_step = min(val_losses, key=lambda pair: pair[1])[0]
    assert trainer.best_checkpoint().endswith(f"checkpoint-{best_step:09d}.pt")

    framework_log.clear()
    fresh = Trainer(Predicting().untrained(), make_args(tmp_path, epochs=3))
    untrained = fresh.validate()
    assert untrained["val_loss"] != current["val_loss"]
    assert any("neither trained nor loaded" in line and "checkpoint='last'" in line for line in framework_log)
    assert fresh.validate(checkpoint="last") == current  # the same weights, bitwise the same metrics
    best = fresh.validate(checkpoint="best")
    assert best["val_loss"] == min(value for _, value in val_losses)
    path = str(tmp_path / "ckpt" / f"checkpoint-{best_step:09d}.pt")
    assert fresh.validate(checkpoint=path) == best
    assert fresh.test(checkpoint=path)["test_loss"] == best["val_loss"]
    with pytest.raises(TypeError, match=r"validate\(checkpoint=3\): allowed: None"):
        fresh.validate(checkpoint=3)
    empty = Trainer(Predicting(), make_args(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        empty.validate(checkpoint="last")


def _evaluation_rank(rank, out):
    out = pathlib.Path(out)
    module = Predicting()
    trainer = Trainer(module, make_args(out, backend="ddp"))
    trainer.train()
    best = trainer.best_checkpoint()
    trained_metrics = trainer.validate()
    in_memory = trainer.predict()
    directory = trainer.predict(predictions_dir=str(out / "predictions"))
    fresh = Trainer(Predicting().untrained(), make_args(out, backend="ddp"))
    last_metrics = fresh.validate(checkpoint="last")
    best_predictions = fresh.predict(checkpoint="best")
    fresh.close()
    trainer.close()
    return dict(
        best=best, trained=trained_metrics, last=last_metrics, memory=in_memory, dir=directory, best_pred=best_predictions
    )


@pytest.mark.distributed
def test_two_ranks_predict_once_in_order_and_load_the_same_checkpoint(tmp_path):
    rank0, rank1 = run_ranks(_evaluation_rank, out=str(tmp_path))
    assert rank0["best"] is not None and rank1["best"] == rank0["best"]  # rank 1 knows it too
    assert rank0["last"] == rank0["trained"] and rank1["last"] == rank1["trained"]
    assert rank1["memory"] is None and rank1["dir"] is None and rank1["best_pred"] is None
    assert rank0["dir"] == str(tmp_path / "predictions")
    reference = Predicting()
    load_weights(reference, str(tmp_path / "ckpt"), step="last")
    expected = reference.expected()
    assert torch.allclose(rank0["memory"]["logits"], expected["logits"], atol=1e-6)
    assert torch.equal(rank0["memory"]["label"], expected["label"])
    files = sorted(os.listdir(tmp_path / "predictions"))
    assert {name.split("-")[1] for name in files} == {"rank0", "rank1"}  # each rank wrote its share
    from_disk = load_predictions(str(tmp_path / "predictions"))
    assert torch.equal(from_disk["logits"], rank0["memory"]["logits"])
    load_weights(reference, rank0["best"])
    assert torch.allclose(rank0["best_pred"]["logits"], reference.expected()["logits"], atol=1e-6)
