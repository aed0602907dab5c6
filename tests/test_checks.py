"""Bad input is refused early, by name: argument types, what the module's methods return,
hook signatures, and checkpoints that do not fit the resuming run (through real training)."""

import logging
import os
import re

import pytest
import torch
from torch.utils.data import DataLoader

from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback
from framework.checkpoint import DefaultCheckpointerArguments
from framework.config.cli import parse_config
from framework.loop import module_checks as checks
from framework.loop.module_checks import CheckpointMismatch


def arguments(tmp_path, **values):
    values.setdefault("checkpointer_args", DefaultCheckpointerArguments(period=0, save_at_end=False))
    return TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path), log_level="WARNING", **values)


class CountingSteps(ToyModule):
    """Counts train_step calls, so a test can show an error came before the first step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps_run = 0

    def train_step(self, global_step, batch, device):
        self.steps_run += 1
        return super().train_step(global_step, batch, device)


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"epochs": 2.5}, r"TrainerArguments.epochs=2.5 \(a float\) is invalid; allowed: an integer$"),
        ({"epochs": "3"}, r"TrainerArguments.epochs='3' \(a str\) is invalid; allowed: an integer$"),
        ({"train_batch_size": 16.0}, r"TrainerArguments.train_batch_size=16.0 \(a float\) is invalid; allowed: an integer"),
        (
            {"max_train_steps_per_epoch": True},
            r"max_train_steps_per_epoch=True \(a bool\) is invalid; allowed: None, an integer or a number",
        ),
        ({"use_gpu": "no"}, r"TrainerArguments.use_gpu='no' \(a str\) is invalid; allowed: None or a boolean \(True/False\)"),
        ({"clip_grads": 1}, r"TrainerArguments.clip_grads=1 \(a int\) is invalid; allowed: a boolean"),
        ({"max_steps": 10.0}, r"TrainerArguments.max_steps=10.0 \(a float\) is invalid; allowed: None or an integer"),
        ({"backend": None}, r"TrainerArguments.backend=None \(a NoneType\) is invalid; allowed: a string"),
        ({"checkpointer_args": DefaultCheckpointerArguments()}, None),
    ],
)
def test_trainer_arguments_refuse_wrong_types_by_field(fields, message):
    if message is None:
        TrainerArguments(**fields)
        return
    with pytest.raises(TypeError, match=message):
        TrainerArguments(**fields)


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40])
def test_seed_outside_numpys_range_is_refused(seed):
    with pytest.raises(ValueError, match=rf"TrainerArguments.seed={seed} is invalid; allowed: an integer from 0 to 2\*\*32 - 1"):
        TrainerArguments(seed=seed)


def test_optional_fields_accept_none_and_numbers_accept_ints(tmp_path):
    args = TrainerArguments(max_steps=None, use_gpu=None, max_time=30, max_grad_norm=2, seed=2**32 - 1, output_dir=tmp_path)
    assert args.max_time == 30 and args.output_dir == str(tmp_path)  # a Path is stored as its str


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"period": 1.0}, r"checkpointer.period=1.0 \(a float\) is invalid; allowed: an integer"),
        ({"async_save": "yes"}, r"checkpointer.async_save='yes' \(a str\) is invalid; allowed: a boolean"),
        (
            {"save_every_n_steps": True},
            r"checkpointer.save_every_n_steps=True \(a bool\) is invalid; allowed: None or an integer",
        ),
        ({"metric": 3}, r"checkpointer.metric=3 \(a int\) is invalid; allowed: a string"),
    ],
)
def test_checkpointer_arguments_refuse_wrong_types(fields, message):
    with pytest.raises(TypeError, match=message):
        DefaultCheckpointerArguments(**fields)


def test_command_line_strings_are_converted_before_the_check():
    config = parse_config(
        argv=[
            "--trainer.epochs",
            "3",
            "--trainer.use_gpu",
            "no",
            "--trainer.max_train_steps_per_epoch",
            "0.5",
            "--checkpointer.async_save",
            "--checkpointer.period",
            "2",
        ]
    )
    assert (config.trainer.epochs, config.trainer.use_gpu, config.trainer.max_train_steps_per_epoch) == (3, False, 0.5)
    assert (config.checkpointer.async_save, config.checkpointer.period) == (True, 2)


# -- get_optimizers_schedulers ------------------------------------------------------------------
class ReturnsOptimizers(CountingSteps):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return self.make(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))


@pytest.mark.parametrize(
    "make, got",
    [
        (lambda optimizer, scheduler: optimizer, "got SGD"),
        (lambda optimizer, scheduler: None, "got NoneType"),
        (lambda optimizer, scheduler: [optimizer], "got a list of 1 items"),
        (lambda optimizer, scheduler: (optimizer, scheduler), r"got \(SGD, StepLR\)"),
        (lambda optimizer, scheduler: ([optimizer], scheduler), r"got \(list, StepLR\)"),
    ],
)
def test_get_optimizers_schedulers_wrong_shape_names_the_method_and_the_shape(tmp_path, make, got):
    module = ReturnsOptimizers(make)
    with pytest.raises(TypeError, match=r"get_optimizers_schedulers must return \(\[optimizers\], \[schedulers\]\).*" + got):
        Trainer(module, arguments(tmp_path)).train()
    assert module.steps_run == 0


def test_get_optimizers_schedulers_items_must_be_optimizers_and_schedulers(tmp_path):
    with pytest.raises(TypeError, match=r"get_optimizers_schedulers: optimizer 0 is a Linear, not a torch.optim.Optimizer"):
        Trainer(ReturnsOptimizers(lambda optimizer, scheduler: ([torch.nn.Linear(1, 1)], [])), arguments(tmp_path)).train()
    with pytest.raises(TypeError, match=r"get_optimizers_schedulers: scheduler 0 is a float, not a learning-rate scheduler"):
        Trainer(ReturnsOptimizers(lambda optimizer, scheduler: ([optimizer], [0.1])), arguments(tmp_path)).train()


def test_none_for_schedulers_still_means_no_scheduler(tmp_path):
    module = ReturnsOptimizers(lambda optimizer, scheduler: ([optimizer], None))
    Trainer(module, arguments(tmp_path, max_steps=2)).train()
    assert module.steps_run == 2


# -- the train loader -------------------------------------------------------------------------
def test_train_loader_none_is_refused(tmp_path):
    class NoLoader(CountingSteps):
        def get_train_dataloader(self, sampler, batch_size):
            return None

    with pytest.raises(TypeError, match=r"get_train_dataloader returned None; it must return a DataLoader"):
        Trainer(NoLoader(), arguments(tmp_path)).train()


def test_train_loader_without_batches_is_refused_naming_length_and_batch_size(tmp_path):
    class DropsEverything(CountingSteps):
        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds), drop_last=True)

    saving = DefaultCheckpointerArguments(period=1, save_at_end=True, save_dir=str(tmp_path / "ckpt"))
    module = DropsEverything(n_train=20)
    with pytest.raises(
        ValueError,
        match=r"get_train_dataloader returned a loader with 0 batches \(len\(loader\) == 0\) from a "
        r"dataset of 20 samples with drop_last=True, with batch size 32 per process",
    ):
        Trainer(module, arguments(tmp_path, train_batch_size=32, checkpointer_args=saving)).train()
    assert module.steps_run == 0 and not (tmp_path / "ckpt").exists()  # no empty checkpoint


# -- train_step's loss ------------------------------------------------------------------------
def test_a_loss_without_grad_names_train_step(tmp_path):
    class DetachedLoss(CountingSteps):
        def train_step(self, global_step, batch, device):
            return super().train_step(global_step, batch, device).detach()

    with pytest.raises(ValueError, match=r"train_step returned a loss that does not require grad.*torch.no_grad\(\)"):
        Trainer(DetachedLoss(), arguments(tmp_path)).train()


def test_the_loss_check_runs_on_the_first_step_only(tmp_path, monkeypatch):
    calls = []
    original = checks.check_loss_requires_grad
    monkeypatch.setattr(checks, "check_loss_requires_grad", lambda loss, module: calls.append(loss) or original(loss, module))
    module = CountingSteps()
    Trainer(module, arguments(tmp_path, epochs=2, train_batch_size=32)).train()  # 16 steps
    assert module.steps_run == 16 and len(calls) == 1


def test_the_loss_check_does_not_apply_under_manual_optimization():
    module = ToyModule()
    module.automatic_optimization = False  # the user runs backward; a detached loss is only logged
    checks.check_loss_requires_grad(torch.tensor(1.0), module)
    module.automatic_optimization = True
    with pytest.raises(ValueError, match="train_step returned a loss that does not require grad"):
        checks.check_loss_requires_grad(torch.tensor(1.0), module)


# -- hooks ------------------------------------------------------------------------------------
def test_a_module_hook_with_a_wrong_signature_fails_at_setup(tmp_path):
    class LateEpochHook(CountingSteps):
        def on_begin_train_epoch(self, epoch):
            pass

    module = LateEpochHook()
    with pytest.raises(
        TypeError,
        match=r"LateEpochHook.on_begin_train_epoch\(epoch\) does not fit the hook: it is called as "
        r"on_begin_train_epoch\(global_step, epoch\)",
    ):
        Trainer(module, arguments(tmp_path)).train()
    assert module.steps_run == 0


def test_a_step_hook_without_room_for_the_outputs_fails_at_setup(tmp_path):
    class NoOutputs(CountingSteps):
        def on_end_train_step(self, global_step):
            pass

    class NoValOutputs(Callback):
        def on_end_val_step(self, global_step, key):
            pass

    module = NoOutputs()
    with pytest.raises(
        TypeError,
        match=r"NoOutputs.on_end_train_step\(global_step\) does not fit the hook: it is called as "
        r"on_end_train_step\(global_step, \*outputs\) \(it takes 1 positional argument\(s\), the trainer passes 1 and "
        r"then the step's outputs \(at least the loss\): add \*outputs\)",
    ):
        Trainer(module, arguments(tmp_path)).train()
    assert module.steps_run == 0
    with pytest.raises(TypeError, match=r"NoValOutputs.on_end_val_step\(global_step, key\) does not fit the hook"):
        Trainer(CountingSteps(), arguments(tmp_path / "val"), callbacks=[NoValOutputs()]).train()


def test_module_setup_runs_once_knowing_its_rank_before_loaders_and_optimizers(tmp_path):
    calls = []

    class RankAware(CountingSteps):
        def setup(self):
            calls.append(("setup", self.global_rank, self.world_size))
            self.head = torch.nn.Linear(2, 2)  # built here: trained and checkpointed like the rest

        def get_train_dataloader(self, sampler, batch_size):
            calls.append(("loader",))
            return super().get_train_dataloader(sampler, batch_size)

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            calls.append(("optimizers",))
            return super().get_optimizers_schedulers(estimated_global_steps_per_epoch, epochs)

    module = RankAware()
    trainer = Trainer(module, arguments(tmp_path, epochs=1))
    assert calls == [("setup", 0, 1)]
    trainer.train()
    assert calls == [("setup", 0, 1), ("loader",), ("optimizers",)]
    assert any(parameter is module.head.weight for parameter in module.parameters())


def test_a_lightning_style_module_setup_with_a_stage_is_refused_at_construction(tmp_path):
    class Ported(CountingSteps):
        def setup(self, stage):
            pass

    with pytest.raises(TypeError, match=r"Ported.setup\(stage\) does not fit the hook: it is called as setup\(\)"):
        Trainer(Ported(), arguments(tmp_path))


def test_a_callback_hook_without_key_fails_at_setup(tmp_path):
    class NoKey(Callback):
        def on_end_val_epoch(self, global_step, *outputs):
            pass

    module = CountingSteps()
    with pytest.raises(
        TypeError,
        match=r"NoKey.on_end_val_epoch\(global_step, \*outputs\) does not fit the hook: it is called as "
        r"on_end_val_epoch\(global_step, \*outputs, key\) \(it has no 'key' parameter",
    ):
        Trainer(module, arguments(tmp_path), callbacks=[NoKey()]).train()
    assert module.steps_run == 0


def test_hooks_that_name_their_outputs_are_accepted(tmp_path):
    class Named(Callback):
        def __init__(self):
            self.accuracy = None

        def on_end_val_epoch(self, global_step, losses, correct, key):
            self.accuracy = float(correct.mean())

        def on_end_optimizer_step(self, global_step, *unused, **more):
            pass

    named = Named()
    Trainer(CountingSteps(), arguments(tmp_path), callbacks=[named]).train()
    assert 0.0 <= named.accuracy <= 1.0


def test_test_without_test_loaders_says_so(tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("framework")
    logger.addHandler(handler)
    try:
        assert Trainer(ToyModule(), arguments(tmp_path)).test() == {}
    finally:
        logger.removeHandler(handler)
    assert any("get_test_dataloaders returned no loader" in record.getMessage() for record in records)


# -- resuming ---------------------------------------------------------------------------------
class Optimizers(ToyModule):
    """``layout`` picks the optimizers/schedulers: 'one', 'two', 'groups', 'no-scheduler'."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        first, second = self.net[0], self.net[3]
        if self.layout == "two":
            optimizers = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
        elif self.layout == "groups":
            optimizers = [torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1)]
        else:
            optimizers = [torch.optim.SGD(self.parameters(), lr=0.1)]
        schedulers = [] if self.layout == "no-scheduler" else [torch.optim.lr_scheduler.StepLR(optimizers[0], 2)]
        return optimizers, schedulers


def saved_run(tmp_path, layout="one"):
    directory = str(tmp_path / "ckpt")
    Trainer(
        Optimizers(layout), arguments(tmp_path, max_steps=2, checkpointer_args=DefaultCheckpointerArguments(save_dir=directory))
    ).train()
    (path,) = [os.path.join(directory, name) for name in os.listdir(directory)]
    return directory, path


@pytest.mark.parametrize(
    "layout, problem",
    [
        ("two", r"it holds 1 optimizer\(s\), get_optimizers_schedulers returned 2"),
        ("groups", r"optimizer 0 has 1 parameter group\(s\) in it, 2 in this run"),
        ("no-scheduler", r"it holds 1 scheduler\(s\), get_optimizers_schedulers returned 0"),
    ],
)
def test_resuming_with_other_optimizers_names_the_file_and_the_way_out(tmp_path, layout, problem):
    directory, path = saved_run(tmp_path)
    resume = DefaultCheckpointerArguments(save_dir=directory, resume="auto")
    with pytest.raises(
        CheckpointMismatch,
        match=rf"checkpoint (file://)?{path} does not match this run's optimizers and schedulers: {problem}\. "
        r".*reset_optimizers_schedulers=True",
    ):
        Trainer(Optimizers(layout), arguments(tmp_path, max_steps=4, checkpointer_args=resume)).train()


def test_reset_optimizers_schedulers_is_the_way_out(tmp_path):
    directory, _ = saved_run(tmp_path)
    weights_only = DefaultCheckpointerArguments(
        load_dir=directory, save_dir=str(tmp_path / "new"), reset_optimizers_schedulers=True
    )
    trainer = Trainer(Optimizers("two"), arguments(tmp_path / "new", max_steps=3, checkpointer_args=weights_only))
    trainer.train()
    assert trainer.global_steps_finished == 3  # fresh counters, the saved weights


def test_a_missing_key_in_the_trainer_state_names_the_key_and_the_file(tmp_path):
    directory, path = saved_run(tmp_path)
    data = torch.load(path, weights_only=True)
    del data["trainer"]["ranks"]
    torch.save(data, path)
    resume = DefaultCheckpointerArguments(save_dir=directory, resume="auto")
    with pytest.raises(CheckpointMismatch, match=rf"checkpoint (file://)?{path}: its trainer state has no 'ranks' entry"):
        Trainer(Optimizers("one"), arguments(tmp_path, max_steps=4, checkpointer_args=resume)).train()
    del data["trainer"]["optimizers"]
    torch.save(data, path)
    with pytest.raises(CheckpointMismatch, match=rf"checkpoint (file://)?{path}: its trainer state has no 'optimizers' entry"):
        Trainer(Optimizers("one"), arguments(tmp_path, max_steps=4, checkpointer_args=resume)).train()


# -- load_weights -----------------------------------------------------------------------------
def test_load_weights_last_best_step_and_file_without_a_trainer(tmp_path):
    from toy import flat_parameters

    from framework.checkpoint import load_weights

    directory = str(tmp_path / "ckpt")
    saving = DefaultCheckpointerArguments(save_dir=directory, period=1)
    trainer = Trainer(ToyModule(), arguments(tmp_path, epochs=3, train_batch_size=64, checkpointer_args=saving))
    history = trainer.train()
    trained = flat_parameters(trainer.module)
    fresh = ToyModule(seed=5)
    assert load_weights(fresh, directory).endswith("checkpoint-000000012.pt")  # "last"
    assert torch.equal(flat_parameters(fresh), trained)
    val_losses = dict(history.steps("val_loss"))
    best_step = min(val_losses, key=val_losses.get)
    assert load_weights(ToyModule(seed=5), directory, step="best").endswith(f"checkpoint-{best_step:09d}.pt")
    worst = load_weights(ToyModule(seed=5), directory, step="best", mode="max")
    assert worst.endswith(f"checkpoint-{max(val_losses, key=val_losses.get):09d}.pt")
    by_step = ToyModule(seed=5)
    load_weights(by_step, directory, step=4)
    assert not torch.equal(flat_parameters(by_step), trained)
    plain = torch.nn.Sequential(*ToyModule().net)  # not a ModuleInterface: its state_dict is loaded
    wrapped = torch.nn.Module()
    wrapped.net = plain
    load_weights(wrapped, os.path.join(directory, "checkpoint-000000012.pt"))
    assert torch.equal(flat_parameters(wrapped), trained)
    export = trainer.save_model_checkpoint()  # model-*.pt: the module state alone
    from_export = ToyModule(seed=5)
    load_weights(from_export, export)
    assert torch.equal(flat_parameters(from_export), trained)
    with pytest.raises(FileNotFoundError, match=re.escape("checkpoint-000000005.pt' does not exist")):
        load_weights(ToyModule(), directory, step=5)
    with pytest.raises(ValueError, match=r"no checkpoint in .* has a recorded 'accuracy'"):
        load_weights(ToyModule(), directory, step="best", metric="accuracy")
    with pytest.raises(ValueError, match=r"step='first' is invalid; allowed: 'last', 'best' or an optimizer step"):
        load_weights(ToyModule(), directory, step="first")
