"""``backends/strategies/meta_init.py`` in one process: meta-built layers allocated and initialized from the
run's seed, ``init_weights()`` preferred, layers built normally kept, a layer with no way to be
initialized refused by name. The 2-rank cases (memory per rank, fsdp against sp) are in
``test_fsdp_layouts.py``."""

import pytest
import torch

from toy import ToyModule, toy_args

from backends.strategies.meta_init import materialize, move_module
from framework import Trainer


class Scale(torch.nn.Module):
    """A layer with a parameter and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class MetaToy(ToyModule):
    """ToyModule whose second layer is built on the meta device (its first one normally)."""

    def __init__(self, extra: bool = False, init_weights: bool = False) -> None:
        super().__init__(n_train=32, val_loaders=0)
        first = self.net[0]
        with torch.device("meta"):
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
            if extra:
                self.net.append(Scale())
        self.net[0] = first  # built normally: its values are kept
        self.first = first.weight.detach().clone()
        self.init_calls = 0
        self.start: tuple = ()
        if init_weights:
            self.init_weights = self._init_weights

    def on_begin_train_epoch(self, global_step, epoch):
        if not self.start:  # the weights training starts from
            layers = (self.net[2].weight, self.net[2].bias, self.net[0].weight)
            self.start = tuple(tensor.detach().clone() for tensor in layers)

    def _init_weights(self) -> None:
        self.init_calls += 1
        for layer in (self.net[0], self.net[2]):
            torch.nn.init.normal_(layer.weight, std=0.02)
            torch.nn.init.zeros_(layer.bias)


def test_meta_layers_are_allocated_and_drawn_from_the_run_seed_and_normal_layers_kept(tmp_path):
    module = MetaToy()
    assert move_module(module, torch.device("cpu")).net[2].weight.is_meta  # the trainer's move leaves meta alone
    trainer = Trainer(module, toy_args(tmp_path, max_steps=1, seed=7))
    torch.rand(3)  # draws between the seeding and the build do not change what the layers get
    trainer.train()
    torch.manual_seed(7)  # the run's seed
    expected = torch.nn.Linear(32, 4)  # what one process draws for the layer built normally
    assert torch.equal(module.start[0], expected.weight) and torch.equal(module.start[1], expected.bias)
    assert torch.equal(module.start[2], module.first)  # the layer built normally keeps its values
    assert not module.net[2].weight.is_meta


def test_init_weights_is_called_once_instead_of_reset_parameters():
    module = MetaToy(init_weights=True)
    torch.manual_seed(3)
    names = materialize(module, torch.device("cpu"))
    assert module.init_calls == 1 and names == ["net.2"]
    assert torch.equal(module.net[2].bias, torch.zeros(4))
    first = module.net[2].weight.clone()
    again = MetaToy(init_weights=True)
    torch.manual_seed(3)
    materialize(again, torch.device("cpu"))
    assert torch.equal(again.net[2].weight, first)  # deterministic from the seed


def test_reset_parameters_draws_what_a_normal_build_draws_from_the_seed():
    with torch.device("meta"):
        built = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    torch.manual_seed(11)
    materialize(built, torch.device("cpu"))
    torch.manual_seed(11)
    normal = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    for (name, mine), (_, theirs) in zip(built.state_dict().items(), normal.state_dict().items()):
        assert torch.equal(mine, theirs), name


def test_a_meta_layer_without_reset_parameters_or_init_weights_is_refused_by_name():
    module = MetaToy(extra=True)
    with pytest.raises(ValueError, match=r"\['net.3'\] have no reset_parameters\(\).*define init_weights\(\)"):
        materialize(module, torch.device("cpu"))
