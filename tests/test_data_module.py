"""``framework.DataModule`` (``framework/data/data_module.py``): Lightning's LightningDataModule given to
the Trainer; the framework's samplers and batch sizes, prepare_data on rank zero, setup per stage, state in
checkpoints."""

import pytest
import torch
from torch.utils.data import DataLoader

from toy import ToyModule, flat_parameters, toy_args

from framework import DataModule, ModuleInterface, Trainer
from framework.checkpoint import DefaultCheckpointerArguments


class ModelOnly(ToyModule):
    """A LightningModule that leaves its data to a data module: no loader methods of its own."""

    get_train_dataloader = ModuleInterface.get_train_dataloader
    get_val_dataloaders = ModuleInterface.get_val_dataloaders
    get_test_dataloaders = ModuleInterface.get_test_dataloaders


class ToyData(DataModule):
    """ToyModule's data sets as a data module, recording what the trainer called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []
        self.served = 0

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")
        source = ToyModule()
        self.train, self.val = source.train_ds, source.val_ds

    def train_dataloader(self, sampler, batch_size):
        self.served += 1
        return DataLoader(self.train, batch_size=batch_size, sampler=sampler(self.train))

    def val_dataloader(self, sampler, batch_size):
        return DataLoader(self.val, batch_size=batch_size, sampler=sampler(self.val))

    def test_dataloader(self, sampler, batch_size):
        return DataLoader(self.val, batch_size=batch_size, sampler=sampler(self.val))

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.calls.append(f"load_state_dict:{state}")
        self.served = state["served"]


def test_a_data_module_trains_as_the_modules_own_loaders_do(tmp_path):
    # Fault: loaders not taken from the data module, its setup skipped or run per loader, or the
    # framework's sampler replaced (mutant: data_module_loader without setup -> AttributeError; the
    # weights of the same data through the module's own loaders differ if the sampler were not used).
    own = ToyModule(scheduler=None)
    own_history = Trainer(own, toy_args(tmp_path / "own", epochs=2, train_batch_size=32)).train()
    data, module = ToyData(), ModelOnly(scheduler=None)
    trainer = Trainer(module, toy_args(tmp_path / "data", epochs=2, train_batch_size=32), datamodule=data)
    trainer.train()
    assert torch.equal(flat_parameters(module), flat_parameters(own))
    assert trainer.history.values("val_loss") == own_history.values("val_loss")
    assert data.calls == ["prepare_data", "setup:fit"]  # once each; validation needs no other setup after fit
    trainer.test()
    assert data.calls == ["prepare_data", "setup:fit", "setup:test"]
    assert module.datamodule is data


def test_its_state_travels_in_checkpoints(tmp_path):
    # Fault: the data module's state_dict not saved or not restored (mutant: get_state without the
    # "datamodule" entry -> load_state_dict never called on resume).
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    first = ToyData()
    Trainer(ModelOnly(scheduler=None), toy_args(tmp_path, epochs=1, checkpoints=checkpoints), datamodule=first).train()
    assert first.served >= 1
    second = ToyData()
    Trainer(ModelOnly(scheduler=None), toy_args(tmp_path, epochs=2, checkpoints=checkpoints), datamodule=second).train()
    assert f"load_state_dict:{{'served': {first.served}}}" in second.calls


def test_what_is_not_a_data_module_and_a_module_without_data_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"datamodule=dict is invalid; allowed: a framework.DataModule"):
        Trainer(ModelOnly(), toy_args(tmp_path / "a"), datamodule={"train": []})  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"defines no get_train_dataloader.*given no datamodule="):
        Trainer(ModelOnly(), toy_args(tmp_path / "b")).train()


def data_module_ranks(rank: int, out: str) -> list:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    data = ToyData()
    trainer = Trainer(ModelOnly(scheduler=None), toy_args(out, backend="ddp", train_batch_size=32), datamodule=data)
    trainer.train()
    trainer.close()
    return data.calls


@pytest.mark.distributed
@pytest.mark.slow  # about 25 s on 2 shared cores
def test_prepare_data_runs_on_rank_zero_only_and_setup_on_every_rank(tmp_path):
    # Fault: prepare_data on every rank (mutant: attach_data_module calls data.prepare_data() directly).
    from distributed import run_ranks

    first, second = run_ranks(data_module_ranks, out=str(tmp_path))
    assert first == ["prepare_data", "setup:fit"] and second == ["setup:fit"]


CONFIG = """
trainer: {epochs: 2, train_batch_size: 32, seed: 0, disable_tqdm: true, log_level: WARNING, sanity_val_steps: 0}
checkpointer: {period: 0, save_at_end: false}
model: {class_path: test_data_module.ModelOnly, init_args: {scheduler: null}}
data: {class_path: test_data_module.ToyData}
"""


def test_the_configs_data_section_naming_a_data_module_goes_to_the_trainer(tmp_path):
    # Fault: LightningCLI's data: section handed to the model's constructor (refused: ModelOnly takes no
    # data=) or dropped (the run has no loaders), or built twice; a module built in code not given it.
    from framework.config.cli import parse_config

    path = tmp_path / "cli.yaml"
    path.write_text(CONFIG)
    config = parse_config(argv=["--config", str(path), "--trainer.output_dir", str(tmp_path / "run")])
    module = config.build_module()
    trainer = Trainer(module, config.trainer)
    trainer.train()
    assert isinstance(module.datamodule, ToyData) and module.datamodule.calls == ["prepare_data", "setup:fit"]
    direct = ModelOnly(scheduler=None)
    Trainer(direct, toy_args(tmp_path / "direct", epochs=2, train_batch_size=32), datamodule=ToyData()).train()
    assert torch.equal(flat_parameters(module), flat_parameters(direct))  # the same run as datamodule=ToyData()
    assert "data:\n  class_path: test_data_module.ToyData" in (tmp_path / "run" / "config.yaml").read_text()

    in_code = ModelOnly(scheduler=None)  # the module built in code, the data from the config
    config = parse_config(argv=["--data.class_path", "test_data_module.ToyData", "--trainer.output_dir", str(tmp_path / "b")])
    Trainer(in_code, config.trainer).validate()
    assert in_code.datamodule.calls == ["prepare_data", "setup:validate"]
    given = ToyData()  # datamodule= wins over the config's section
    Trainer(ModelOnly(), config.trainer, datamodule=given).validate()
    assert given.calls == ["prepare_data", "setup:validate"]
