"""ModuleInterface.save_hyperparameters (Lightning's name): captured from __init__, self.hparams,
config.yaml's hyper_parameters section, checkpoints, and restored with the weights."""

import glob
import os

import pytest
import torch
import yaml

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.checkpoint.weights import load_weights
from framework.config.cli import parse_config


class Classifier(ToyModule):
    """A Lightning-style module: its __init__ arguments are its hyper-parameters."""

    def __init__(self, hidden: int = 32, lr: float = 0.05, sizes=(4, 8), encoder: torch.nn.Module = None, **extra) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.encoder = encoder
        self.save_hyperparameters()


class Wider(Classifier):
    def __init__(self, width: int = 48, lr: float = 0.02) -> None:
        super().__init__(hidden=width, lr=lr * 2, note="wide")


def test_hparams_from_init_into_config_yaml_and_checkpoints_and_back(tmp_path, framework_log):
    """Kills: arguments not captured (or the parent's __init__ winning over the subclass's), the
    config.yaml section missing, the checkpoint without them, update_state not restoring them, a
    module argument saved or skipped silently, --config refusing the section."""
    module = Classifier(hidden=16, lr=0.1, encoder=torch.nn.Linear(2, 2), tag="a")
    assert module.hparams == {"hidden": 16, "lr": 0.1, "sizes": (4, 8), "tag": "a"}
    assert module.hparams.lr == 0.1 and module.hparams.sizes == (4, 8)
    assert [m for m in framework_log if "skipped encoder (Linear)" in m and "ignore=['encoder']" in m], framework_log
    assert Wider().hparams == {"hidden": 48, "lr": 0.02, "sizes": (4, 8), "encoder": None, "note": "wide", "width": 48}

    checkpoints = DefaultCheckpointerArguments(period=1, save_at_end=True)
    Trainer(module, toy_args(tmp_path, checkpoints=checkpoints)).train()
    run = tmp_path / "run"
    with open(run / "config.yaml") as handle:
        written = yaml.safe_load(handle)
    assert written["hyper_parameters"] == {"hidden": 16, "lr": 0.1, "sizes": [4, 8], "tag": "a"}
    assert written["trainer"]["epochs"] == 1  # beside the run's own sections
    assert parse_config(argv=["--config", str(run / "config.yaml")]).trainer.epochs == 1  # a record, not a setting

    saved = torch.load(sorted(glob.glob(os.path.join(run, "checkpoints", "checkpoint-*.pt")))[-1], weights_only=True)
    assert saved["module"]["hyper_parameters"] == {"hidden": 16, "lr": 0.1, "sizes": (4, 8), "tag": "a"}

    fresh = Classifier(hidden=16, lr=0.5, encoder=torch.nn.Linear(2, 2))
    assert fresh.hparams.lr == 0.5
    load_weights(fresh, str(run / "checkpoints"))
    assert fresh.hparams.lr == 0.5  # its own: a record is not a setting (issue 49)
    assert torch.equal(fresh.net[0].weight, module.net[0].weight)
    bare = ToyModule(hidden=16)  # saved none of its own: takes the checkpoint's
    bare.encoder = torch.nn.Linear(2, 2)
    load_weights(bare, str(run / "checkpoints"))
    assert bare.hparams == {"hidden": 16, "lr": 0.1, "sizes": (4, 8), "tag": "a"}


def test_a_fine_tune_records_its_own_hyper_parameters_not_the_loaded_runs(tmp_path):
    """Fault (issue 49): run B (lr 0.5) loading run A's weights (lr 0.1) recorded lr 0.1 in its
    checkpoints while its config.yaml said 0.5 (update_state replacing hparams)."""
    Trainer(Classifier(hidden=16, lr=0.1), toy_args(tmp_path / "a", DefaultCheckpointerArguments(period=1))).train()
    loaded = sorted(glob.glob(str(tmp_path / "a" / "run" / "checkpoints" / "checkpoint-*.pt")))[-1]
    tuned = Classifier(hidden=16, lr=0.5)
    Trainer(tuned, toy_args(tmp_path / "b", DefaultCheckpointerArguments(period=1, load_filename=loaded))).train()
    assert tuned.hparams.lr == 0.5
    run = tmp_path / "b" / "run"
    saved = torch.load(sorted(glob.glob(str(run / "checkpoints" / "checkpoint-*.pt")))[-1], weights_only=True)
    assert saved["module"]["hyper_parameters"]["lr"] == 0.5
    assert yaml.safe_load((run / "config.yaml").read_text())["hyper_parameters"]["lr"] == 0.5


class Named(ToyModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05, table=None) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.save_hyperparameters(*self.names)

    names: tuple = ()


def test_names_dicts_and_refusals():
    """Kills: names not honoured, a tensor or module accepted by name or in a dict, an unknown name
    or a call outside __init__ passing unnoticed."""
    Named.names = ("lr",)
    assert Named(lr=0.3).hparams == {"lr": 0.3}
    Named.names = ("table",)
    with pytest.raises(TypeError, match=r"table \(Tensor\) cannot be saved in config.yaml or a checkpoint"):
        Named(table=torch.ones(2))
    with pytest.raises(TypeError, match=r"table\['w'\]\[1\] cannot be saved"):
        Named(table={"w": [1, torch.nn.ReLU()]})
    Named.names = ("lr", "rate")
    with pytest.raises(ValueError, match=r"\['rate'\] are not arguments of __init__; it has \['hidden', 'lr', 'table'\]"):
        Named()
    module = Classifier()
    module.save_hyperparameters({"optimizer": {"name": "adamw", "betas": [0.9, 0.99]}})
    assert module.hparams.optimizer["betas"] == [0.9, 0.99]
    with pytest.raises(TypeError, match=r"weights \(Tensor\)"):
        module.save_hyperparameters({"weights": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="call it inside __init__"):
        module.save_hyperparameters()
    assert ToyModule().hparams == {} and "hyper_parameters" not in ToyModule().get_state()


class Vocabulary(ToyModule):
    def __init__(self, vocabulary=(), tree=None) -> None:
        super().__init__()
        self.save_hyperparameters()


def nested(levels: int) -> list:
    value: list = [1]
    for _ in range(levels - 1):
        value = [value]
    return value


def test_hparams_that_config_yaml_cannot_hold_are_refused_when_saved_and_the_rest_reads_back(tmp_path):
    """Issue 49: a 100 001-word vocabulary, or nesting over 200 levels, made config.yaml unreadable (its reader
    refuses it) with nothing said at write time. Now the largest that fit write and read back whole (a real run),
    and one more word or level is refused by save_hyperparameters naming the field (mutant: check_writable not
    called -> the module is made and the run writes a config.yaml its reader refuses)."""
    from framework.config.bounded_yaml import load_yaml
    from framework.config.hyperparameters import UnwritableHyperParameter
    from framework.run.run_identity import recorded_run_id

    words = [f"w{index}" for index in range(98_000)]
    module = Vocabulary(vocabulary=words, tree=nested(198))
    Trainer(module, toy_args(tmp_path, max_steps=1)).train()
    written = load_yaml((tmp_path / "run" / "config.yaml").read_text())
    assert written["hyper_parameters"]["vocabulary"] == words and written["hyper_parameters"]["tree"] == nested(198)
    assert recorded_run_id(str(tmp_path / "run")) is not None

    with pytest.raises(UnwritableHyperParameter, match=r"vocabulary holds 100002 values; config.yaml holds at most 100000"):
        Vocabulary(vocabulary=["w"] * 100_001)
    with pytest.raises(UnwritableHyperParameter, match=r"tree is nested 199 levels deep; .* at most 198 levels"):
        Vocabulary(tree=nested(199))
    module = Vocabulary()
    module.hparams.tree = nested(300)  # changed after it was saved: refused when the trainer takes it
    with pytest.raises(UnwritableHyperParameter, match="tree is nested 300 levels"):
        Trainer(module, toy_args(tmp_path / "second", max_steps=1))


def test_a_hyper_parameter_that_holds_itself_is_refused_naming_it(tmp_path):
    """A self-referencing list was a RecursionError naming nothing (mutant: the recursive walk back -> RecursionError)."""
    from framework.config.hyperparameters import UnwritableHyperParameter

    loop: list = [1, 2]
    loop.append(loop)
    with pytest.raises(UnwritableHyperParameter, match=r"tree\[2\] is tree itself \(a list that contains itself\)"):
        Vocabulary(tree=loop)
    shared = [1, 2]
    assert Vocabulary(tree=[shared, shared]).hparams.tree == [[1, 2], [1, 2]]  # shared, not a cycle: fine
