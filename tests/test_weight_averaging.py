"""EMA and SWA callbacks (``framework/callbacks/ema.py``, ``swa.py``, ``weight_averaging.py``)
on one process; 2-rank ddp/fsdp runs are in ``test_memory_distributed.py``, and kill -9
resumes with both callbacks at the end of this file."""

import os

import pytest
import torch
import torch.nn.functional as F
from test_resume import expect_killed, finish, result

from toy import ToyModule, flat_parameters, toy_args

from framework import Trainer
from framework.callbacks import EMA, SWA, Callback


class WeightsAfterEachStep(Callback):
    def __init__(self) -> None:
        self.weights = []
        self.learning_rates = []

    def on_end_optimizer_step(self, global_step):
        self.weights.append({k: v.detach().clone() for k, v in self.trainer.module.state_dict().items()})
        self.learning_rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def test_ema_is_the_exponential_average_of_the_weights_and_training_is_unchanged(tmp_path):
    ema, recorder = EMA(decay=0.8), WeightsAfterEachStep()
    trainer = Trainer(ToyModule(), toy_args(tmp_path / "ema", epochs=2), callbacks=[ema, recorder])
    trainer.train()
    expected = None
    for weights in recorder.weights:  # the first update copies, then average = 0.8 * average + 0.2 * weights
        expected = dict(weights) if expected is None else {k: 0.8 * expected[k] + 0.2 * weights[k] for k in weights}
    averaged = ema.averaged_state_dict()
    assert ema.updates == len(recorder.weights) == 16
    assert max((averaged[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    plain = Trainer(ToyModule(), toy_args(tmp_path / "plain", epochs=2))
    plain.train()
    assert torch.equal(flat_parameters(trainer.module), flat_parameters(plain.module))  # training weights are back
    # Validation evaluated the average: the same loss as a module holding the averaged weights.
    evaluated = ToyModule()
    evaluated.load_state_dict(averaged)
    loss = Trainer(evaluated, toy_args(tmp_path / "check")).validate()["val_loss"]
    assert trainer.history.latest("val_loss") == pytest.approx(loss, rel=1e-6)
    assert trainer.history.latest("val_loss") != pytest.approx(plain.history.latest("val_loss"), rel=1e-3)
    with ema.applied():
        assert torch.equal(flat_parameters(trainer.module), torch.cat([averaged[k].flatten() for k in averaged]))
    assert torch.equal(flat_parameters(trainer.module), flat_parameters(plain.module))


def test_ema_every_n_steps_and_without_validation(tmp_path):
    ema = EMA(decay=0.5, every_n_steps=3, use_for_validation=False)
    trainer = Trainer(ToyModule(), toy_args(tmp_path / "ema", epochs=2), callbacks=[ema])
    trainer.train()
    plain = Trainer(ToyModule(), toy_args(tmp_path / "plain", epochs=2))
    plain.train()
    assert ema.updates == 16 // 3
    assert trainer.history.latest("val_loss") == plain.history.latest("val_loss")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: EMA(decay=1.5), "EMA decay=1.5 is invalid; allowed: a number in [0, 1]"),
        (lambda: EMA(every_n_steps=0), "EMA every_n_steps=0 is invalid; allowed: an integer >= 1"),
        (lambda: SWA(swa_lrs=-1.0), "SWA swa_lrs=-1.0 is invalid; allowed: a number > 0"),
        (lambda: SWA(swa_lrs=0.1, swa_epoch_start=1.5), "SWA swa_epoch_start=1.5 is invalid"),
        (lambda: SWA(swa_lrs=0.1, annealing_strategy="exp"), "annealing_strategy='exp' is invalid; allowed: 'cos', 'linear'"),
    ],
)
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        make()


class BatchNormToy(ToyModule):
    def __init__(self) -> None:
        super().__init__(scheduler=None)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def test_swa_averages_epochs_from_the_start_epoch_and_recomputes_batch_norm(tmp_path):
    swa, recorder = SWA(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=2, annealing_strategy="linear"), WeightsAfterEachStep()
    module = BatchNormToy()
    trainer = Trainer(module, toy_args(tmp_path / "swa", epochs=4), callbacks=[swa, recorder])
    trainer.train()
    steps = 8  # per epoch
    ends = [recorder.weights[epoch * steps + steps - 1] for epoch in (1, 2, 3)]
    names = [name for name, _ in module.named_parameters()]
    for name in names:
        assert torch.allclose(module.state_dict()[name], sum(end[name] for end in ends) / 3, atol=1e-6)
    assert swa.updates == 3
    # Learning rates: the scheduler-free rate 0.05 until epoch 1, then linearly to 0.01 over two epochs.
    assert recorder.learning_rates[steps - 1] == pytest.approx(0.05)
    assert recorder.learning_rates[2 * steps - 1] == pytest.approx(0.03)
    assert recorder.learning_rates[3 * steps - 1] == pytest.approx(0.01)
    # Batch-norm statistics of the averaged weights over the training data (equal batches: the mean).
    features = module.net[0](module.train_ds.tensors[0]).detach()
    assert torch.allclose(module.net[1].running_mean, features.mean(0), atol=1e-5)
    assert module.net[1].momentum == 0.1


@pytest.mark.slow
def test_ema_and_swa_resume_exactly_after_kill_9(tmp_path):
    averaging = ("--ema", "0.9", "--swa-start", "1")  # killed inside the second SWA epoch
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    finish(reference_dir, *averaging)
    expect_killed(killed_dir, "KILLING at mb:2:9", "--kill", "mb:2:9", *averaging)
    finish(killed_dir, "--kill", "mb:2:9", *averaging)
    reference, resumed = result(reference_dir), result(killed_dir)
    for key in ("params", "EMA", "SWA"):
        assert torch.equal(resumed[key], reference[key]), key
    assert resumed["history"] == reference["history"]
    assert os.path.exists(killed_dir / "checkpoints")


def test_swa_resumed_mid_annealing_uses_its_annealed_rate_without_a_configured_lr_warning(tmp_path, framework_log):
    from framework.checkpoint import DefaultCheckpointerArguments

    def swa():
        return SWA(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=2, annealing_strategy="linear")

    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    Trainer(ToyModule(n_train=32, scheduler=None), toy_args(tmp_path, checkpoints, epochs=2), callbacks=[swa()]).train()
    recorder = WeightsAfterEachStep()
    resumed = Trainer(
        ToyModule(n_train=32, scheduler=None), toy_args(tmp_path, checkpoints, epochs=3), callbacks=[swa(), recorder]
    )
    resumed.train()
    assert recorder.learning_rates and recorder.learning_rates == [pytest.approx(0.01)] * len(recorder.learning_rates)  # SWA's
    assert not [line for line in framework_log if "using the configured" in line]
