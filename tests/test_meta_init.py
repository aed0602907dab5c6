"""``backends/strategies/meta_init.py`` in one process: meta-built layers allocated and initialized from the
run's seed, ``init_weights()`` preferred, layers built normally kept, a layer with no way to be
initialized refused by name; and on 2 gloo ranks under ``model-parallel`` (1x2 and 2x1): the plan and
the sharding applied on meta, each rank's memory at start below the model's, the same training as the
model built normally. The fsdp cases (memory per rank, fsdp against sp) are in ``test_fsdp_layouts.py``."""

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


# -- model-parallel: the tensor-parallel plan and FSDP applied on the meta device, 2 gloo ranks ------------------------

WIDE, DEPTH, SEED = 1024, 16, 42  # 16 blocks of 4 MiB: a 67 MiB model


class WideNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, WIDE)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDE, WIDE) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDE, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = torch.tanh(block(x)) / 4
        return self.head(x)


class WideModule(ToyModule):
    """``WideNet`` built normally (from the run's seed), under ``torch.device("meta")`` in ``__init__``, or in
    ``configure_model()``; every block split by the plan (columns, rows, alternately)."""

    def __init__(self, build: str) -> None:
        super().__init__(n_train=64, scheduler=None, lr=0.01, val_loaders=0)
        del self.net
        self.build, self.baseline, self.peak, self.local_bytes = build, 0, 0, 0
        if build == "normal":
            torch.manual_seed(SEED)
            self.net = WideNet()
        elif build == "meta":
            with torch.device("meta"):
                self.net = WideNet()

    def configure_model(self) -> None:
        if self.build == "hook":
            self.net = WideNet()

    def tensor_parallel_plan(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {f"net.blocks.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(DEPTH)}

    def on_begin_train_epoch(self, global_step, epoch):
        if not self.peak:  # the first step is next: what the start cost this rank
            self.peak = peak_rss() - self.baseline
            self.local_bytes = sum(_local(p).numel() * p.element_size() for p in self.parameters())


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def model_parallel_runs(rank: int, out: str) -> dict:
    import datetime
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: dict = {}
    for tp, build in ((2, "normal"), (2, "meta"), (2, "hook"), (1, "meta")):  # meshes 1x2, 2x1; normal pays one-time costs
        baseline = reset_peak_rss()
        module = WideModule(build)
        module.baseline = baseline
        args = toy_args(
            os.path.join(out, f"{tp}-{build}"), backend="model-parallel", tensor_parallel_size=tp, seed=SEED, max_steps=2
        )
        trainer = Trainer(module, args)
        torch.rand(rank + 1)  # draws between the seeding and the build (differently per rank) change nothing
        trainer.train()
        full = module.net.state_dict()
        results[f"{tp} {build}"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in full.items()}
        results[f"{tp} {build} peak"], results[f"{tp} {build} local"] = module.peak, module.local_bytes
    dist.destroy_process_group()
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_a_meta_built_model_under_model_parallel_starts_in_its_shard_and_trains_as_built_normally(tmp_path):
    """The plan was applied before configure_model() built the layers, and every rank built the whole model."""
    import os

    from distributed import run_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors go back to the system: RSS is what lives
    try:
        ranks = run_ranks(model_parallel_runs, out=str(tmp_path), timeout=240)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
    size = sum(t.numel() * t.element_size() for t in ranks[0]["2 normal"].values())
    for results in ranks:
        assert results["2 normal peak"] > size  # built whole, then split
        for run in ("2 meta", "2 hook", "1 meta"):  # 1x2: the plan's halves; 2x1: FSDP's halves
            assert results[f"{run} local"] < 0.6 * size, run  # this rank's shards only
            assert results[f"{run} peak"] < 0.75 * size, (run, results[f"{run} peak"], size)
            for name, tensor in results[run].items():  # the same initialization from the seed, the same training
                assert (tensor - ranks[0]["2 normal"][name]).abs().max() <= 1e-5, (run, name)
