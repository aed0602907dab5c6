"""Bad input gets an early, clear error that names the bad value and what is allowed."""

import pytest
import torch

from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.config.arguments import micro_batch_plan
from framework.config.cli import ConfigError, parse_config


class WrongReturn(ToyModule):
    def train_step(self, global_step, batch, device):
        return "not a loss"


def test_wrong_train_step_return_type(tmp_path):
    trainer = Trainer(WrongReturn(), TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path)))
    with pytest.raises(TypeError, match=r"train_step must return a loss tensor.*got str"):
        trainer.train()


def test_unknown_backend_lists_known_names():
    built_ins = ["ddp", "ddp-amp", "ddp-bf16", "fsdp", "fsdp-amp", "fsdp-bf16", "model-parallel", "model-parallel-amp"]
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'") as raised:  # plugins installed here may be listed too
        Trainer(ToyModule(), TrainerArguments(backend="tpu"))
    assert all(f" {name}," in str(raised.value) for name in [*built_ins, "model-parallel-bf16", "sp"])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"train_batch_size": 0}, r"train_batch_size=0 is invalid; allowed: an integer >= 1"),
        ({"epochs": -1}, r"epochs=-1 is invalid"),
        (
            {"max_train_steps_per_epoch": 1.5},
            r"max_train_steps_per_epoch=1.5 is invalid; allowed: None, an integer >= 1, or a fraction",
        ),
        ({"scheduler_interval": "batch"}, r"scheduler_interval='batch' is invalid; allowed: 'step' or 'epoch'"),
        ({"amp_dtype": "float8"}, r"amp_dtype='float8'"),
        ({"log_level": "LOUD"}, r"log_level='LOUD'"),
    ],
)
def test_invalid_arguments(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainerArguments(**fields)


def test_batch_not_divisible_into_micro_batches():
    with pytest.raises(ValueError, match=r"gpu_batch_size_limit=8 does not divide.*30.*e\.g\. 6, 5, 3"):
        micro_batch_plan(30, world_size=1, gpu_batch_size_limit=8)
    with pytest.raises(ValueError, match=r"train_batch_size=33 is not divisible by the data-parallel size 2"):
        micro_batch_plan(33, world_size=2, gpu_batch_size_limit=None)
    with pytest.raises(ValueError, match="gpu_batch_size_limit=8"):
        Trainer(ToyModule(), TrainerArguments(train_batch_size=30, gpu_batch_size_limit=8))


def test_fp16_on_cpu_is_refused():
    with pytest.raises(ValueError, match=r"amp_dtype='float16' needs a CUDA device"):
        Trainer(ToyModule(), TrainerArguments(backend="sp-amp", amp_dtype="float16", use_gpu=False))


def test_use_gpu_without_gpu():
    if torch.cuda.is_available():
        return
    with pytest.raises(ValueError, match=r"use_gpu=True but torch.cuda.is_available\(\) is False"):
        Trainer(ToyModule(), TrainerArguments(use_gpu=True))


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' does not exist"):
        parse_config(argv=["--config", "nope.yaml"])


def test_unknown_config_key_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.epoch'.*did you mean 'trainer.epochs'"):
        parse_config(argv=["--trainer.epoch", "3"])


def test_bad_config_value_type():
    with pytest.raises(ConfigError, match=r"trainer.epochs='three'.*expected an integer"):
        parse_config(argv=["--trainer.epochs", "three"])


def test_module_type_checked():
    with pytest.raises(TypeError, match="module must be a ModuleInterface, got Linear"):
        Trainer(torch.nn.Linear(2, 2))


def test_arguments_type_checked():
    with pytest.raises(TypeError, match="args must be TrainerArguments, got dict"):
        Trainer(ToyModule(), {"epochs": 1})


def test_optimizers_required(tmp_path):
    class NoOptimizer(ToyModule):
        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [], []

    with pytest.raises(ValueError, match="returned no optimizer"):
        Trainer(NoOptimizer(), TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path))).train()


def test_validation_loaders_must_be_a_loader_or_dict(tmp_path):
    class ListOfLoaders(ToyModule):
        def get_val_dataloaders(self, sampler, batch_size):
            return [super().get_val_dataloaders(sampler, batch_size)]

    trainer = Trainer(ListOfLoaders(), TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path)))
    with pytest.raises(TypeError, match=r"get_val_dataloaders must return a DataLoader, a dict of DataLoaders or None; got list"):
        trainer.validate()


def test_wrong_val_step_return_type(tmp_path):
    class WrongVal(ToyModule):
        def val_step(self, global_step, batch, device):
            return 3.0

    trainer = Trainer(WrongVal(), TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path)))
    with pytest.raises(TypeError, match=r"val_step must return a loss tensor.*got float"):
        trainer.validate()


def test_mid_epoch_resume_needs_the_framework_sampler(tmp_path):
    from torch.utils.data import DataLoader, RandomSampler

    class OwnSampler(ToyModule):
        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(self.train_ds, batch_size=batch_size, sampler=RandomSampler(self.train_ds))

    def args(**checkpointer):
        values = TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path), train_batch_size=32, max_steps=3)
        for name, value in checkpointer.items():
            setattr(values.checkpointer_args, name, value)
        return values

    Trainer(ToyModule(), args(save_every_n_steps=3)).train()  # the framework's sampler: saved mid-epoch (8 steps per epoch)
    resumed = Trainer(OwnSampler(), args(resume="auto"))  # the same checkpoint, read by a loader that cannot skip
    resumed.args.max_steps = 6
    with pytest.raises(
        ValueError, match=r"needs the train loader's sampler to support fast_forward\(n\), and RandomSampler does not"
    ):
        resumed.train()
