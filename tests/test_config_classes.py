"""LightningCLI-style sections (framework/config/class_path.py through framework/config/cli.py): what a
class_path may name, init_args checked against the signature and its types, the lr_scheduler, data
and trainer.callbacks sections honoured in a real run, unknown sections refused, Lightning's names."""

import pytest
import torch

from toy import ToyModule

from framework import Trainer
from framework.callbacks import Callback
from framework.config.class_path import ALLOW_ANY_CALLABLE
from framework.config.cli import ConfigError, parse_config


class ConfiguredToy(ToyModule):
    """A module that takes what the optimizer, lr_scheduler and data sections build."""

    def __init__(self, optimizer=None, lr_scheduler=None, data=None, hidden: int = 8) -> None:
        super().__init__(n_train=64, n_val=16, hidden=hidden, scheduler=None)
        self.make_optimizer, self.make_scheduler, self.data = optimizer, lr_scheduler, data

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = self.make_optimizer(self.parameters())
        self.schedulers = [self.make_scheduler(optimizer)] if self.make_scheduler else []
        return [optimizer], self.schedulers


class TrainSet(torch.utils.data.TensorDataset):
    def __init__(self, size: int = 4) -> None:
        super().__init__(torch.zeros(size, 16))


class StepCounter(Callback):
    def __init__(self, every: int = 1) -> None:
        self.every, self.steps = every, 0

    def on_end_train_step(self, *args, **kwargs) -> None:
        self.steps += 1


def error_of(argv) -> str:
    with pytest.raises(ConfigError) as raised:
        parse_config(argv=argv)
    return str(raised.value)


SECTIONS = """
trainer: {max_epochs: 2, train_batch_size: 16, seed: 0, disable_tqdm: true, log_level: WARNING,
          callbacks: [{class_path: test_config_classes.StepCounter, init_args: {every: 2}}]}
checkpointer: {period: 0, save_at_end: false}
model: {class_path: test_config_classes.ConfiguredToy, init_args: {hidden: 8}}
optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.4}}
lr_scheduler: {class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 1, gamma: 0.5}}
data: {class_path: test_config_classes.TrainSet, init_args: {size: 3}}
"""


def test_lightning_sections_are_honoured_in_a_run(tmp_path, framework_log):
    """Kills: an lr_scheduler, data or trainer.callbacks section dropped (the run trains without it),
    max_epochs not read as epochs, trainer.callbacks lost by own_copy (the trainer's copy of the args)."""
    path = tmp_path / "cli.yaml"
    path.write_text(SECTIONS)
    config = parse_config(argv=["--config", str(path), "--trainer.output_dir", str(tmp_path / "run")])
    warned = " ".join(framework_log)  # the framework's loggers do not propagate to caplog once a run has set them up
    assert config.trainer.epochs == 2 and "trainer.max_epochs (from" in warned and "read as trainer.epochs" in warned
    module = config.build_module()
    assert len(module.data) == 3  # the data section, built and handed over
    trainer = Trainer(module, config.trainer)
    trainer.train()
    counters = [callback for callback in trainer.callbacks if isinstance(callback, StepCounter)]
    assert len(counters) == 1 and counters[0].every == 2 and counters[0].steps == trainer.global_steps_finished == 8
    (scheduler,) = module.schedulers
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 0.5**8)  # stepped every optimizer step
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "lr_scheduler:" in saved and "test_config_classes.StepCounter" in saved and "data:" in saved


def test_what_a_class_path_may_name(monkeypatch):
    """Kills: a class_path that runs any callable (os.system ran with init_args), a non-class reported
    late ('float' object is not callable), an optimizer section naming a model class blamed on the model."""
    assert "'math.pi' names a float, not a class" in error_of(["--model.class_path", "math.pi"])
    assert "names a builtin_function_or_method, not a class" in error_of(
        ["--model.class_path", "os.system", "--model.init_args.command", "touch /tmp/config-ran"]
    )
    assert "standard library" in error_of(["--model.class_path", "subprocess.Popen", "--model.init_args.args", "true"])
    message = error_of(["--model.class_path", "test_config_classes.ConfiguredToy", "--optimizer.class_path", "torch.nn.Linear"])
    assert message.startswith("optimizer.class_path 'torch.nn.Linear' is not an optimizer"), message
    assert "lr_scheduler.class_path 'torch.optim.SGD' is not a learning-rate scheduler" in error_of(
        ["--model.class_path", "test_config_classes.ConfiguredToy", "--lr_scheduler.class_path", "torch.optim.SGD"]
    )
    monkeypatch.setenv(ALLOW_ANY_CALLABLE, "1")  # the documented opt-in: a config is then code
    assert parse_config(argv=["--model.class_path", "collections.OrderedDict"]).build_module() == {}


def test_init_args_are_checked_against_the_signature_and_types(tmp_path):
    """Kills: init_args passed unchecked (the failure comes from inside torch), a list of init_args
    reported as an unknown key."""
    assert error_of(["--model.class_path", "torch.nn.Linear", "--model.init_args.in_features", "two"]) == (
        "model.init_args.in_features='two': torch.nn.Linear takes in_features: int; expected an integer, got 'two'"
    )
    assert error_of(["--model.class_path", "torch.nn.Linear", "--model.init_args", "[1, 2]"]) == (
        "model.init_args must be a mapping of argument names to values ({name: value}), got list [1, 2]"
    )
    path = tmp_path / "typo.yaml"
    path.write_text("model: {class_path: torch.nn.Linear, init_arg: {in_features: 2}}\n")
    assert error_of(["--config", str(path)]) == (
        "model: unknown key 'init_arg' beside class_path; allowed: class_path, init_args; did you mean 'init_args'?"
    )


def test_unknown_sections_and_unused_ones_are_refused_all_at_once(tmp_path):
    """Kills: a section nothing uses (an lr_scheduler without a model class, a class_path under a name no
    one reads) ignored; only the first of several mistakes reported."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        "trainer: {max_epoch: 2, log_every_n_steps: 0, epochs: 0, gradient_clip_val: 1.0}\n"
        "lr_scheduler: {class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 1}}\n"
        "callbacks: {class_path: test_config_classes.StepCounter}\n"
        "seed_everything: 3\n"
    )
    lines = error_of(["--config", str(path)]).splitlines()
    assert lines[0] == "7 config errors:", lines
    text = "\n".join(lines)
    for expected in (
        "'seed_everything' (from",
        "here it is trainer.seed",
        "section 'callbacks' names a class (class_path), which only the sections model, optimizer, lr_scheduler, data may",
        "the 'lr_scheduler' section is handed to the model section's class as lr_scheduler=, but the config has no model",
        "unknown config key 'trainer.max_epoch'",
        "trainer.gradient_clip_val (from",
        "TrainerArguments.log_every_n_steps=0 is invalid",
        "TrainerArguments.epochs=0 is invalid",
    ):
        assert expected in text, (expected, text)


def test_a_model_that_takes_no_scheduler_refuses_the_section():
    message = error_of(["--model.class_path", "torch.nn.Linear", "--lr_scheduler.class_path", "torch.optim.lr_scheduler.StepLR"])
    assert "takes no 'lr_scheduler' argument; add one (a callable: optimizer -> scheduler)" in message


def test_lightnings_callbacks_point_to_their_counterparts(tmp_path):
    # Fault: a LightningCLI trainer.callbacks entry refused with "cannot import lightning" and no way
    # on (mutant: lightning_callback_hint returns "" -> that message, neither checkpointer: nor ours).
    config = tmp_path / "lightning.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        "    - {class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {monitor: val_acc, save_top_k: 2}}\n"
        "    - {class_path: lightning.pytorch.callbacks.EarlyStopping, init_args: {monitor: val_acc}}\n"
    )
    message = error_of(["--config", str(config)])
    assert "trainer.callbacks[0].class_path 'lightning.pytorch.callbacks.ModelCheckpoint': Lightning's " in message
    assert "is the checkpointer: section here" in message and "checkpointer.keep_best_n (save_top_k)" in message
    assert "checkpointer.metric (monitor)" in message
    assert "trainer.callbacks[1].class_path 'lightning.pytorch.callbacks.EarlyStopping': Lightning's class: use " in message
    assert "class_path: framework.callbacks.EarlyStopping" in message
