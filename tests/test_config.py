"""framework.config.cli: YAML + dotted overrides, type checks, suggestions, --help, user sections,
and the config.yaml the trainer writes."""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Literal, Optional, Tuple, Union

import pytest
import torch
import yaml

from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.config.cli import ConfigError, RunConfig, convert, format_help, parse_config, resolved_config


@dataclass
class ModelArguments:
    """The model section of a user script."""

    width: int = 64
    """Hidden width."""
    dropout: float = 0.1
    """Dropout probability."""
    layers: List[int] = field(default_factory=lambda: [32, 16])
    """Widths of the extra layers."""
    activation: Literal["relu", "gelu"] = "relu"
    """Non-linearity."""
    pretrained: Optional[str] = None
    """Path of pretrained weights."""
    frozen: bool = False
    """Freeze the encoder."""

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width={self.width} must be >= 1")


def write_yaml(tmp_path, data, name="run.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def config_error(argv, sections=None) -> str:
    with pytest.raises(ConfigError) as error:
        parse_config(sections, argv=argv)
    return str(error.value)


# -- values and precedence ----------------------------------------------------------------


def test_defaults_then_file_then_command_line(tmp_path):
    path = write_yaml(tmp_path, {"trainer": {"epochs": 4, "seed": 7}, "checkpointer": {"period": 2}, "model": {"width": 8}})
    config = parse_config({"model": ModelArguments}, argv=["--config", path, "--trainer.epochs=9", "--model.layers", "[1, 2, 3]"])
    assert (config.trainer.epochs, config.trainer.seed, config.trainer.train_batch_size) == (9, 7, 32)
    assert config.checkpointer.period == 2 and config.trainer.checkpointer_args is config.checkpointer
    assert config.model == ModelArguments(width=8, layers=[1, 2, 3])


def test_backend_shortcut_on_the_command_line_and_in_yaml(tmp_path):
    assert parse_config(argv=["--backend", "ddp-amp"]).trainer.backend == "ddp-amp"
    assert parse_config(argv=["--backend=ddp"]).trainer.backend == "ddp"
    path = write_yaml(tmp_path, {"backend": "sp-amp", "trainer": {"epochs": 2}})
    assert parse_config(argv=["--config", path]).trainer.backend == "sp-amp"


def test_values_are_converted_to_the_field_types(tmp_path):
    config = parse_config(
        {"model": ModelArguments},
        argv=[
            "--trainer.max_time",
            "none",
            "--trainer.max_train_steps_per_epoch",
            "0.5",
            "--trainer.max_val_steps_per_epoch",
            "3",
            "--trainer.tensorboard",  # a bare boolean flag is true
            "--model.frozen",
            "yes",
            "--model.layers",
            "4,5",
            "--model.activation",
            "gelu",
            "--model.pretrained",
            "weights.pt",
            "--model.dropout",
            "1e-2",
        ],
    )
    trainer, model = config.trainer, config.model
    assert trainer.max_time is None and trainer.tensorboard is True
    assert trainer.max_train_steps_per_epoch == 0.5 and isinstance(trainer.max_val_steps_per_epoch, int)
    assert (model.frozen, model.layers, model.activation, model.pretrained, model.dropout) == (
        True,
        [4, 5],
        "gelu",
        "weights.pt",
        0.01,
    )


def test_yaml_floats_stay_floats_where_the_field_allows_both(tmp_path):
    # 1.0 means "the whole loader" (a fraction), not "one step".
    path = write_yaml(tmp_path, {"trainer": {"max_train_steps_per_epoch": 1.0, "max_val_steps_per_epoch": 2}})
    trainer = parse_config(argv=["--config", path]).trainer
    assert trainer.max_train_steps_per_epoch == 1.0 and isinstance(trainer.max_train_steps_per_epoch, float)
    assert trainer.max_val_steps_per_epoch == 2 and isinstance(trainer.max_val_steps_per_epoch, int)


def test_convert_handles_tuples_and_rejects_what_does_not_fit():
    assert convert("[1, 2.5]", Tuple[int, float]) == (1, 2.5)
    assert convert("8", Union[int, str]) == 8
    with pytest.raises(ValueError, match="expected 2 items, got 3"):
        convert("[1, 2, 3]", Tuple[int, float])
    with pytest.raises(ValueError, match="expected an integer, got None"):
        convert(None, int, from_text=False)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainer.epochs", "three"], "trainer.epochs='three' (from command line): expected an integer, got 'three'"),
        (["--trainer.epochs", "2.5"], "expected an integer, got '2.5'"),
        (
            ["--trainer.clip_grads", "maybe"],
            "trainer.clip_grads='maybe' (from command line): expected a boolean (true/false), got 'maybe'",
        ),
        (["--trainer.max_grad_norm", "big"], "expected a number, got 'big'"),
        (
            ["--model.activation", "tanh"],
            "model.activation='tanh' (from command line): expected one of ['relu', 'gelu'], got 'tanh'",
        ),
        (["--model.layers", "{a: 1}"], "expected a list, got '{a: 1}'"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_the_expected_type(argv, message):
    assert message in config_error(argv, {"model": ModelArguments})


def test_bad_values_in_yaml_name_the_file(tmp_path):
    path = write_yaml(tmp_path, {"trainer": {"epochs": None, "output_dir": ["a"]}})
    assert f"trainer.epochs=None (from {path}): expected an integer, got None" in config_error(["--config", path])
    path = write_yaml(tmp_path, {"trainer": {"output_dir": ["a"]}}, "list.yaml")
    assert "trainer.output_dir=['a']" in config_error(["--config", path]) and "expected a string, got list" in config_error(
        ["--config", path]
    )


def test_values_rejected_by_the_dataclass_name_the_section():
    message = config_error(["--trainer.epochs", "0"])
    assert message.startswith("section 'trainer': TrainerArguments.epochs=0 is invalid; allowed: an integer >= 1")
    assert "section 'model': width=0 must be >= 1" in config_error(["--model.width=0"], {"model": ModelArguments})


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--trainer.epoch", "3"], "did you mean 'trainer.epochs'?"),
        (["--trainer.save_dir", "s3://bucket/run"], "did you mean 'checkpointer.save_dir'?"),  # right field, wrong section
        (["--modle.width", "3"], "did you mean 'model.width'?"),
        (["--epochs", "3"], "did you mean 'trainer.epochs'?"),
        (["--model.widht", "3"], "did you mean 'model.width'?"),
    ],
)
def test_an_unknown_key_suggests_the_closest_valid_key(argv, suggestion):
    message = config_error(argv, {"model": ModelArguments})
    assert f"unknown config key '{argv[0][2:]}' (from command line); {suggestion}" == message


def test_an_unknown_key_in_yaml_names_the_file_and_suggests(tmp_path):
    path = write_yaml(tmp_path, "trainer:\n  epochs: 2\n  lerning_rate: 0.1\n")
    assert config_error(["--config", path], {"model": ModelArguments}) == (
        f"unknown config key 'trainer.lerning_rate' (from {path}); valid sections: ['checkpointer', 'model', 'trainer']"
    )
    path = write_yaml(tmp_path, {"model": {"widht": 3}}, "model.yaml")
    assert config_error(["--config", path], {"model": ModelArguments}) == (
        f"unknown config key 'model.widht' (from {path}); did you mean 'model.width'?"
    )


def test_file_problems_are_reported_with_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert f"config file {missing!r} does not exist" == config_error(["--config", missing])
    assert "is not valid YAML" in config_error(["--config", write_yaml(tmp_path, "trainer: [unclosed", "bad.yaml")])
    assert "must hold a mapping of sections, got list" in config_error(["--config", write_yaml(tmp_path, "- 1\n", "list.yaml")])
    empty = write_yaml(tmp_path, "trainer:\ncheckpointer:\n", "empty.yaml")  # empty sections are fine
    assert parse_config(argv=["--config", empty]).trainer == TrainerArguments()


def test_malformed_command_lines_say_what_is_expected():
    assert "unexpected argument 'epochs'; use --config FILE or --section.field VALUE" in config_error(["epochs"])
    assert "--trainer.epochs needs a value (int)" in config_error(["--trainer.epochs"])
    assert "--config needs a file name" in config_error(["--config"])


# -- help -------------------------------------------------------------------------------------


def test_help_lists_every_field_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config({"model": ModelArguments}, argv=["--trainer.epochs", "2", "--help"], program="train.py")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: train.py [--config FILE.yaml]")
    for section, cls in (("trainer", TrainerArguments), ("model", ModelArguments)):
        for f in dataclasses.fields(cls):
            if f.name != "checkpointer_args":
                assert f"--{section}.{f.name} (" in text
    assert "  --trainer.epochs (int, default 1; this run: 2)\n      Maximum number of epochs." in text  # the other arguments
    assert "trainer:  Arguments of a Trainer run." in text  # docstring markup is stripped
    assert "  --trainer.max_time (Optional[float], default None)" in text
    assert "  --model.layers (List[int], default [32, 16])\n      Widths of the extra layers." in text
    assert "model:  The model section of a user script." in text
    assert "--checkpointer.save_dir (Optional[str], default None)" in text
    assert "checkpointer_args" not in text
    assert format_help({"model": ModelArguments}, "x").count("--model.") == 6


# -- saving ---------------------------------------------------------------------------------


def test_saved_config_loads_back_to_the_same_sections(tmp_path):
    config = parse_config(
        {"model": ModelArguments}, argv=["--trainer.epochs=3", "--checkpointer.keep_last_n=2", "--model.layers=[7]"]
    )
    path = str(tmp_path / "out" / "config.yaml")
    config.save(path, run_id="0123abcd" * 4)  # the run's id: saved, ignored by --config
    again = parse_config({"model": ModelArguments}, argv=["--config", path])
    assert again.to_dict() == config.to_dict()
    assert (again.trainer, again.checkpointer, again.model) == (config.trainer, config.checkpointer, config.model)


def test_the_trainer_writes_the_resolved_config_with_user_sections(tmp_path):
    out = tmp_path / "run"
    config = parse_config(
        {"model": ModelArguments},
        argv=[
            "--trainer.epochs=1",
            f"--trainer.output_dir={out}",
            "--trainer.disable_tqdm",
            "--trainer.log_level=WARNING",
            "--checkpointer.period=0",
            "--checkpointer.save_at_end=false",
            "--model.width=5",
        ],
    )
    assert resolved_config(config.trainer) is config and config.trainer.run_config is config
    Trainer(ToyModule(val_loaders=0), config.trainer).train()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert len(saved.pop("run_id")) == 32  # the run's id first (framework/run/run_identity.py)
    assert saved == config.to_dict() and saved["model"]["width"] == 5 and saved["trainer"]["output_dir"] == str(out)

    # Arguments built in code: the trainer and checkpointer sections.
    args = TrainerArguments(epochs=1, output_dir=str(tmp_path / "code"), disable_tqdm=True, log_level="WARNING", seed=3)
    args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, False
    Trainer(ToyModule(val_loaders=0), args).train()
    saved = yaml.safe_load((tmp_path / "code" / "config.yaml").read_text())
    assert list(saved) == ["run_id", "trainer", "checkpointer"] and saved["trainer"]["seed"] == 3
    assert saved["checkpointer"]["period"] == 0 and saved.pop("run_id")
    assert RunConfig({"trainer": args, "checkpointer": args.checkpointer_args}).to_dict() == saved

    # fast_dev_run writes nothing.
    args = TrainerArguments(epochs=1, output_dir=str(tmp_path / "dev"), disable_tqdm=True, log_level="WARNING", fast_dev_run=True)
    Trainer(ToyModule(val_loaders=0), args).train()
    assert not (tmp_path / "dev" / "config.yaml").exists()


# -- LightningCLI-style class_path / init_args, --print_config ---------------------------------

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)  # class_path: digits.DigitsClassifier


def test_class_path_builds_the_module_and_its_optimizer(tmp_path, examples_on_path):
    cli_yaml = f"{EXAMPLES}/digits_cli.yaml"
    config = parse_config(
        argv=["--config", cli_yaml, "--optimizer.class_path", "torch.optim.SGD", "--optimizer.init_args.lr", "0.05",
              "--optimizer.init_args.weight_decay", "0", "--model.init_args.config.init_args.hidden_size", "16"]
    )  # fmt: skip
    module = config.build_module(default=lambda: pytest.fail("the model section has a class_path"))
    assert type(module).__name__ == "DigitsClassifier" and module.config.hidden_size == 16 and module.config.dropout == 0.1
    (optimizer,), (_schedule,) = module.get_optimizers_schedulers(estimated_global_steps_per_epoch=4, epochs=2)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.05
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in module.parameters()}
    assert config.trainer.output_dir == "outputs/digits-cli"  # the other sections as before
    # The saved config (config.yaml) holds the specs and loads back to the same module.
    config.save(str(tmp_path / "config.yaml"))
    again = parse_config(argv=["--config", str(tmp_path / "config.yaml")])
    assert again.class_specs == config.class_specs and again.to_dict() == config.to_dict()
    assert parse_config(argv=[]).build_module(default=lambda: "default") == "default"  # no class_path: the default


def test_class_path_mistakes_are_config_errors_named_at_once(examples_on_path):
    with pytest.raises(ConfigError) as error:
        parse_config(
            argv=["--config", f"{EXAMPLES}/digits_cli.yaml", "--model.init_args.config.init_args.hiden", "3",
                  "--optimizer.class_path", "torch.optim.AdamX", "--trainer.epoch", "2"]
        )  # fmt: skip
    assert str(error.value).splitlines() == [
        "3 config errors:",
        "  model.init_args.config.init_args.hiden: digits.DigitsArguments takes no argument 'hiden'; did you mean 'hidden_size'?",
        "  optimizer.class_path: class_path 'torch.optim.AdamX': torch.optim has no 'AdamX'; did you mean 'torch.optim.Adam'?",
        "  unknown config key 'trainer.epoch' (from command line); did you mean 'trainer.epochs'?",
    ]
    specs = {"model": {"class_path": "toy.ToyModule"}, "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 1}}}
    with pytest.raises(ValueError, match=r"toy\.ToyModule takes no 'optimizer' argument"):
        _with_specs(specs).build_module()


def _with_specs(specs):
    config = RunConfig({})
    config.class_specs = specs
    return config


def test_print_config_prints_the_resolved_yaml_and_exits(capsys, examples_on_path):
    with pytest.raises(SystemExit) as exited:
        parse_config(argv=["--config", f"{EXAMPLES}/digits_cli.yaml", "--optimizer.init_args.lr", "0.01", "--print_config"])
    assert exited.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"] == {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.0001}}
    assert printed["trainer"]["epochs"] == 10 and printed["checkpointer"]["keep_last_n"] == 2


def test_usage_names_the_running_script(tmp_path):
    # Fault: "usage: run.py" printed for every script (mutant: the default program back to "run.py").
    import subprocess
    import sys

    script = tmp_path / "train_digits.py"
    script.write_text("from framework.config.cli import parse_config\nparse_config()\n")
    result = subprocess.run([sys.executable, str(script), "--trainer.epochz", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: train_digits.py [--config FILE.yaml]"), result.stderr
    assert "train_digits.py: error: " in result.stderr and "run.py" not in result.stderr


def test_none_fits_every_optional_spelling_pep_604_included(tmp_path, monkeypatch):
    """``int | None`` (PEP 604) and ``Optional[int]`` take ``null``, in a class_path's init_args and in a
    dataclass section (mutant: only typing.Union recognised as a union -> "expected int | None, got None")."""
    (tmp_path / "optional_model.py").write_text(
        "from typing import Optional\n"
        "import torch\n\n\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self, hidden: 'int | None' = 4, width: Optional[int] = 3):\n"
        "        super().__init__()\n"
        "        self.hidden, self.width = hidden, width\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config_path = write_yaml(tmp_path, "model:\n  class_path: optional_model.Model\n  init_args: {hidden: null, width: null}\n")
    module = parse_config(argv=["--config", config_path]).build_module()
    assert (module.hidden, module.width) == (None, None)

    @dataclasses.dataclass
    class Section:
        hidden: "int | None" = 4

    Section.__annotations__["hidden"] = int | None  # evaluated, as on Python 3.10+ without postponed annotations
    loaded = parse_config({"model": Section}, argv=["--config", write_yaml(tmp_path, "model: {hidden: null}\n", "d.yaml")])
    assert loaded.model.hidden is None
    assert parse_config({"model": Section}, argv=["--model.hidden", "none"]).model.hidden is None
    assert parse_config({"model": Section}, argv=["--model.hidden", "5"]).model.hidden == 5
    assert "expected an integer" in config_error(["--model.hidden", "five"], {"model": Section})
