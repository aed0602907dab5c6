"""Lightning's names that cost nothing: ``self.log(..., logger=False)`` and the outer
``{"optimizer": ..., "lr_scheduler": {...}}`` return of ``configure_optimizers``."""

import csv

import pytest
import torch

from toy import ToyModule, toy_args

from framework import Trainer
from framework.loop.schedulers import lightning_return


class HiddenMetric(ToyModule):
    def train_step(self, global_step, batch, device):
        loss = super().train_step(global_step, batch, device)
        self.log("debug_norm", loss.detach() * 3, logger=False)
        self.log("shown", loss.detach())
        return loss


def test_log_with_logger_false_stays_out_of_the_loggers_but_reaches_the_history(tmp_path):
    trainer = Trainer(HiddenMetric(val_loaders=0), toy_args(tmp_path, train_batch_size=32))
    trainer.train()
    assert trainer.history.values("debug_norm") and trainer.history.values("shown")
    with open(tmp_path / "run" / "metrics.csv", newline="") as handle:
        names = {row["name"] for row in csv.DictReader(handle)}
    assert "shown" in names and "debug_norm" not in names


class OuterDict(ToyModule):
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        step = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "epoch"}}


def test_lightnings_outer_optimizer_dict_is_honoured_with_its_scheduler(tmp_path):
    trainer = Trainer(OuterDict(val_loaders=0), toy_args(tmp_path, train_batch_size=32, epochs=2))
    trainer.train()
    (optimizer,) = trainer.optimizers
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # stepped once per epoch, two epochs


def test_an_outer_dict_with_an_unknown_key_is_refused_naming_it():
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"\['optimiser'\]; Lightning's outer dict takes \['optimizer', 'lr_scheduler'"):
        lightning_return({"optimiser": optimizer})
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    assert lightning_return([{"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_acc"}]) == (
        [optimizer],
        [{"scheduler": plateau, "monitor": "val_acc"}],
    )


class LogsOnly(ToyModule):
    """Lightning's usual validation step: it logs and returns nothing."""

    def val_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), batch_size=len(y))
        self.log("val_ce", torch.nn.functional.cross_entropy(logits, y), batch_size=len(y))


def test_a_val_step_returning_none_records_what_it_logged_and_ranks_by_it(tmp_path):
    # Fault: a None step refused (mutant: the evaluator's `if returned is None` branch removed -> TypeError
    # naming val_step), or its logged values lost. The logged metric drives early stopping and "best".
    from framework.callbacks import EarlyStopping
    from framework.checkpoint import DefaultCheckpointerArguments

    checkpoints = DefaultCheckpointerArguments(metric="val_ce", mode="min", keep_best_n=1, keep_last_n=0)
    stopper = EarlyStopping(monitor="val_acc", mode="max", patience=2)
    args = toy_args(tmp_path, train_batch_size=32, epochs=3, sanity_val_steps=2, checkpoints=checkpoints)
    trainer = Trainer(LogsOnly(scheduler=None), args, callbacks=[stopper])
    trainer.train()
    history = trainer.history
    assert "val_loss" not in history.names()  # nothing returned: no val_loss
    assert len(history.values("val_acc")) == len(history.values("val_ce")) == trainer.epochs_finished
    assert stopper._seen and stopper.best == max(history.values("val_acc"))
    ce = [(record["value"], record["step"]) for record in history.records if record["name"] == "val_ce"]
    best_step = min(ce)[1]
    assert best_step != ce[-1][1]  # the best is not simply the last: the ranking read val_ce
    assert str(trainer.best_checkpoint()).endswith(f"checkpoint-{best_step:09d}.pt")
    metrics = trainer.validate()
    assert set(metrics) == {"val_acc", "val_ce"}


def test_early_stopping_on_val_loss_under_a_none_val_step_names_what_is_recorded(tmp_path):
    from framework.callbacks import EarlyStopping

    trainer = Trainer(LogsOnly(scheduler=None), toy_args(tmp_path, train_batch_size=32, epochs=2), callbacks=[EarlyStopping()])
    with pytest.raises(ValueError, match=r"monitors 'val_loss', which is never recorded.*val_acc"):
        trainer.train()
