"""An everyday LightningCLI program ported with only the renames of docs/from-lightning.md's table: a
module with ``save_hyperparameters()`` whose ``val_step`` only logs (returns nothing), a data module
given by the config's ``data:`` section, ``EarlyStopping`` and ``LearningRateMonitor`` under
``trainer.callbacks`` and ``ModelCheckpoint``'s arguments in the ``checkpointer:`` section. Run from
its YAML as ``python run.py --config cli.yaml`` runs it, it equals the same program built in code,
and each callback does what Lightning's does."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from toy import flat_parameters, make_classification

from framework import DataModule, ModuleInterface, Trainer, TrainerArguments
from framework.callbacks import EarlyStopping, LearningRateMonitor
from framework.checkpoint import DefaultCheckpointerArguments
from framework.config.cli import parse_config


class LitClassifier(ModuleInterface):
    """A LightningModule, renamed: training_step -> train_step, validation_step -> val_step,
    configure_optimizers -> get_optimizers_schedulers."""

    def __init__(self, hidden: int = 16, lr: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def val_step(self, global_step, batch, device):  # Lightning's usual validation_step: it only logs
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), batch_size=len(y))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)]


class ClassificationData(DataModule):
    """A LightningDataModule, renamed: the loaders take the framework's sampler and batch size."""

    def __init__(self, samples: int = 128) -> None:
        super().__init__()
        self.samples, self.calls = samples, []

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")
        self.train, self.val = make_classification(self.samples, seed=0), make_classification(64, seed=1)

    def train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train, batch_size=batch_size, sampler=sampler(self.train))

    def val_dataloader(self, sampler, batch_size):
        return DataLoader(self.val, batch_size=batch_size, sampler=sampler(self.val))


CLI_YAML = """
trainer:
  max_epochs: 30                     # Lightning's name, read as epochs
  train_batch_size: 32
  log_every_n_steps: 1
  seed: 0
  disable_tqdm: true
  log_level: WARNING
  callbacks:
    - class_path: framework.callbacks.EarlyStopping
      init_args: {monitor: val_acc, mode: max, patience: 2}
    - class_path: framework.callbacks.LearningRateMonitor
      init_args: {logging_interval: step}
checkpointer:                        # ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=1)
  metric: val_acc
  mode: max
  keep_best_n: 1
  keep_last_n: 0
  period: 1
model:
  class_path: test_lightning_cli_port.LitClassifier
  init_args: {hidden: 16, lr: 0.5}
data:
  class_path: test_lightning_cli_port.ClassificationData
  init_args: {samples: 128}
"""


@pytest.mark.slow  # about 45 s on 2 shared cores: two runs until early stopping
def test_a_lightning_cli_program_ports_with_the_renames_and_equals_the_program_in_code(tmp_path):
    """Kills: trainer.callbacks dropped (mutant: RunConfig.build_callbacks returns [] -> 30 epochs, no early
    stop), the data: section not reaching the trainer (mutant: Trainer ignores config_data_module ->
    NotImplementedError), a None val_step recorded as val_loss, more than save_top_k checkpoints kept,
    hyperparameters not saved, and a config run that differs from the same program in code."""
    path = tmp_path / "cli.yaml"
    path.write_text(CLI_YAML)
    config = parse_config(argv=["--config", str(path), "--trainer.output_dir", str(tmp_path / "cli")])
    module = config.build_module()  # what run.py does: module and trainer from the config
    trainer = Trainer(module, config.trainer)
    history = trainer.train()

    assert module.datamodule.calls == ["prepare_data", "setup:fit"]
    assert history.values("val_loss") == []  # nothing returned, nothing made up
    accuracies = history.values("val_acc")
    assert trainer.epochs_finished < 30 and len(accuracies) == trainer.epochs_finished  # stopped early
    assert max(accuracies[-2:]) <= max(accuracies[:-2]), accuracies  # patience 2: the last two did not improve
    rates = history.values("lr")
    assert rates[0] == 0.5 and rates[-1] < 0.5 and len(rates) == trainer.global_steps_finished  # every step
    kept = sorted(os.listdir(tmp_path / "cli" / "checkpoints"))
    assert len([name for name in kept if not name.startswith(".")]) == 1  # save_top_k=1
    assert trainer.checkpointer.best_checkpoint() is not None
    saved = (tmp_path / "cli" / "config.yaml").read_text()
    assert "hyper_parameters:" in saved  # save_hyperparameters(): the init arguments beside the run

    in_code = LitClassifier(hidden=16, lr=0.5)  # the same program written out in code
    args = TrainerArguments(
        epochs=30,
        train_batch_size=32,
        log_every_n_steps=1,
        seed=0,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=str(tmp_path / "code"),
        checkpointer_args=DefaultCheckpointerArguments(metric="val_acc", mode="max", keep_best_n=1, keep_last_n=0, period=1),
    )
    callbacks = [EarlyStopping(monitor="val_acc", mode="max", patience=2), LearningRateMonitor(logging_interval="step")]
    code_history = Trainer(in_code, args, callbacks=callbacks, datamodule=ClassificationData(128)).train()
    assert torch.equal(flat_parameters(in_code), flat_parameters(module))
    assert code_history.values("val_acc") == accuracies and code_history.values("lr") == rates
