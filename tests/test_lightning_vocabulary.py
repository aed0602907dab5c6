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
