"""Model layouts that broke ``fsdp`` (and ``ddp``) on 2 real gloo ranks: batch norm's running
statistics (one truth for training, evaluation and checkpoints), experts that get no tokens on a
rank, a weight tied between a block and the root, and models built on the meta device.

Every scenario runs in one 2-rank process group (``runs``); the collectives time out after
``TIMEOUT`` seconds, so a scenario that hangs fails in seconds, not after ``ddp_timeout``'s 600.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from logs import captured_log

from distributed import run_ranks
from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT = 30.0  # ddp_timeout of every run here: a hang fails the test within it
STOP_AT = 3


def arguments(backend: str, out: str, **overrides) -> TrainerArguments:
    """64 samples, global batch 16, micro-batch 4 (accumulation 2 on 2 ranks): 4 steps an epoch,
    2 epochs, a checkpoint at every epoch's end."""
    values = dict(
        epochs=2,
        train_batch_size=16,
        gpu_batch_size_limit=4,
        backend=backend,
        disable_tqdm=True,
        output_dir=out,
        sanity_val_steps=0,
        ddp_timeout=TIMEOUT,
    )
    values.update(overrides)
    args = TrainerArguments(**values)
    args.checkpointer_args.save_dir = os.path.join(out, "checkpoints")
    return args


class RunningCenter(torch.nn.Module):
    """Subtracts a running mean of its inputs that the training forward reads and updates (an
    observation normalizer): ranks that start a step from different buffers compute different losses."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - self.mean
        if self.training:
            self.mean.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return centered


class NormedNet(torch.nn.Module):
    """Blocks of Linear + BatchNorm1d (two FSDP units): running statistics that each rank updates
    from its own batches; before them a running mean the training forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.center = RunningCenter(32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh()) for width in (16, 32)
        )
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.center(x))


class Experts(torch.nn.Module):
    """A mixture of experts: each sample goes to its router's top expert (an ``nn.ModuleDict``), so
    in a micro-batch of 2 samples an expert often gets none on one rank and some on the other."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(32, 3)
        self.experts = torch.nn.ModuleDict({str(index): torch.nn.Linear(32, 32) for index in range(3)})
        self.skipped = 0  # micro-batches in which an expert got no sample, on this rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for name, expert in self.experts.items():
            rows = (choice == int(name)).nonzero().flatten()
            if rows.numel() == 0:
                self.skipped += 1
                continue
            out = out.index_add(0, rows, expert(x[rows]) * gates[rows, int(name)].unsqueeze(1))
        return x + torch.tanh(out)


class ExpertNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList([Experts(), Experts()])
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class RootTiedNet(torch.nn.Module):
    """A block (an FSDP unit) whose weight is also the root's ``mix`` weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)])
        self.blocks[0].weight = self.mix.weight
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.mix(torch.tanh(self.embed(x))))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


NETS = {"normed": NormedNet, "experts": ExpertNet, "root-tied": RootTiedNet}


class NetModule(ToyModule):
    """``ToyModule`` training ``NETS[net]``; plain SGD when ``momentum`` is 0 (an expert no rank
    used in a step: ddp leaves its gradient None, fsdp reduces zeros; with momentum it would move)."""

    def __init__(self, net: str, momentum: float = 0.9) -> None:
        super().__init__(n_train=64, scheduler=None)
        torch.manual_seed(0)
        self.net = NETS[net]()
        self.momentum = momentum

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def state(trainer: Trainer) -> dict:
    full = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return {name: tensor.detach().clone() for name, tensor in full.items()}


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name].double() - second[name].double()).abs().max().item() for name in first)


def batch_norm_scenarios(out: str, results: dict) -> None:
    for backend in ("ddp", "fsdp"):
        trainer = Trainer(NetModule("normed"), arguments(backend, os.path.join(out, backend)))
        trainer.train()
        results[backend] = state(trainer)
        results[f"{backend} val"] = trainer.validate()["val_loss"]
        results[f"{backend} val last"] = trainer.validate("last")["val_loss"]
        results[f"{backend} checkpoint"] = state(trainer)  # after validate("last"): the checkpoint's tensors
        unsaved_args = arguments(backend, os.path.join(out, f"{backend}-unsaved"))
        unsaved_args.checkpointer_args = DefaultCheckpointerArguments(period=0, save_at_end=False)
        unsaved = Trainer(NetModule("normed"), unsaved_args)  # no save has made the ranks' buffers one
        unsaved.train()
        results[f"{backend} unsaved val"] = unsaved.validate()["val_loss"]
    stopped = Trainer(NetModule("normed"), arguments("fsdp", os.path.join(out, "stopped"), max_steps=STOP_AT))
    stopped.args.checkpointer_args.save_every_n_steps = 1
    stopped.train()
    resumed_args = arguments("fsdp", os.path.join(out, "stopped"))
    resumed_args.checkpointer_args.resume = "auto"
    resumed = Trainer(NetModule("normed"), resumed_args)
    resumed.train()
    results["fsdp resumed"] = state(resumed)
    results["fsdp resumed from"] = resumed.checkpointer.loaded_from


def expert_scenarios(out: str, results: dict) -> None:
    for backend, extra in (("ddp", {"find_unused_parameters": True}), ("fsdp", {})):
        module = NetModule("experts", momentum=0.0)
        args = arguments(backend, os.path.join(out, f"experts-{backend}"), gpu_batch_size_limit=2, **extra)
        try:
            Trainer(module, args).train()
            results[f"experts {backend}"] = state_of(module)
        except Exception as error:  # the failure is the result
            results[f"experts {backend}"] = f"{type(error).__name__}: {error}"
        results[f"experts {backend} skipped"] = [layer.skipped for layer in module.net.layers]


def state_of(module: NetModule) -> dict:
    from torch.distributed.tensor import DTensor

    full = module.net.state_dict()
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in full.items()}


def root_tie_scenarios(out: str, results: dict) -> None:
    for backend in ("ddp", "fsdp"):
        try:
            with captured_log("backends") as messages:
                trainer = Trainer(NetModule("root-tied"), arguments(backend, os.path.join(out, f"tied-{backend}"), epochs=1))
                trainer.train()
            results[f"tied {backend} log"] = [message for message in messages if "shares parameters" in message]
            results[f"tied {backend}"] = state(trainer)
            results[f"tied {backend} parameters"] = len(list(trainer.module.parameters()))
        except Exception as error:  # the failure is the result
            results[f"tied {backend}"] = f"{type(error).__name__}: {error}"


WIDTH, DEPTH = 1024, 16  # 16 blocks of 4 MiB: a 67 MiB model


class WideNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = torch.tanh(block(x)) / 4
        return self.head(x)


class WideModule(NetModule):
    """``WideNet`` built normally, under ``torch.device("meta")`` in ``__init__``, or in ``configure_model()``."""

    def __init__(self, build: str) -> None:
        ToyModule.__init__(self, n_train=64, scheduler=None, lr=0.01, val_loaders=0)
        self.momentum, self.build, self.peak, self.baseline = 0.9, build, None, None
        del self.net
        if build == "normal":
            torch.manual_seed(42)  # the run's seed (TrainerArguments.seed): what meta-built layers are drawn from
            self.net = WideNet()
        elif build == "meta":
            with torch.device("meta"):
                self.net = WideNet()

    def configure_model(self) -> None:
        if self.build == "hook":
            self.net = WideNet()

    def on_begin_train_epoch(self, global_step, epoch):
        if self.peak is None and self.baseline is not None:  # the first step is next: the start's peak
            self.peak = peak_rss() - self.baseline


def peak_rss() -> int:
    """This process's peak resident memory in bytes since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def meta_scenarios(out: str, results: dict) -> None:
    for build in ("normal", "meta", "hook"):  # normal first: it pays the first run's one-time costs
        baseline = reset_peak_rss()
        module = WideModule(build)
        module.baseline = baseline
        args = arguments("fsdp", os.path.join(out, f"wide-{build}"), epochs=1, max_steps=2)
        args.checkpointer_args = DefaultCheckpointerArguments(period=0, save_at_end=False)
        Trainer(module, args).train()
        results[f"wide {build}"] = state_of(module)
        results[f"wide {build} peak"] = module.peak


SCENARIOS = {
    "meta": meta_scenarios,
    "batch norm": batch_norm_scenarios,
    "experts": expert_scenarios,
    "root tie": root_tie_scenarios,
}


def all_scenarios(rank: int, out: str, only: tuple) -> dict:
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    results: dict = {}
    for name in only:
        SCENARIOS[name](out, results)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("layouts"))
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # the ranks' freed tensors go back to the system: RSS is what lives
    try:
        return run_ranks(all_scenarios, out=out, only=tuple(SCENARIOS), timeout=300)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_") if previous is None else os.environ.update(MALLOC_MMAP_THRESHOLD_=previous)


def test_batch_norm_has_one_truth_for_training_evaluation_and_checkpoints(runs):
    """The checkpoint held rank 1's running statistics under fsdp, and validate() evaluated each
    rank's own (0.0767 against validate("last")'s 0.0729); now rank zero's everywhere."""
    first, second = runs
    for backend in ("ddp", "fsdp"):
        assert first[f"{backend} val"] == second[f"{backend} val"], backend
        assert first[f"{backend} val"] == pytest.approx(first[f"{backend} val last"], abs=1e-6), backend
        assert first[f"{backend} unsaved val"] == pytest.approx(first[f"{backend} val"], abs=1e-6), backend
        assert max_difference(first[backend], second[backend]) == 0, backend  # buffers too: one truth after training
        assert max_difference(first[f"{backend} checkpoint"], first[backend]) == 0, backend
    assert max_difference(first["ddp"], first["fsdp"]) <= 1e-5  # fsdp trains batch norm as ddp does


def test_batch_norm_under_fsdp_resumes_bitwise(runs):
    first, second = runs
    assert first["fsdp resumed from"].endswith(f"checkpoint-{STOP_AT:09d}")
    assert max_difference(first["fsdp resumed"], first["fsdp"]) == 0
    assert max_difference(second["fsdp resumed"], first["fsdp"]) == 0


def test_experts_without_tokens_on_a_rank_train_under_fsdp_as_under_ddp(runs):
    """fsdp hung in step 1 until ddp_timeout: a rank whose expert got no sample skipped the
    expert's all-gather and reduce-scatter that the other rank ran."""
    first, second = runs
    assert not isinstance(first["experts fsdp"], str), first["experts fsdp"]
    assert min(first["experts fsdp skipped"]) > 0 and min(second["experts fsdp skipped"]) > 0
    assert first["experts fsdp skipped"] != second["experts fsdp skipped"]  # the ranks skipped different experts
    assert max_difference(first["experts ddp"], first["experts fsdp"]) <= 1e-5


def test_a_weight_tied_between_a_block_and_the_root_trains_as_under_ddp(runs):
    """FSDP2 refused it ("already managed by another FSDP group"), a fix the user could not apply."""
    first, second = runs
    assert not isinstance(first["tied fsdp"], str), first["tied fsdp"]
    assert first["tied fsdp log"] == [
        "fsdp: unit 'net.blocks.0' shares parameters with the root (net.blocks.0: net.mix.weight), so each is sharded "
        "with the root, whose parameters stay gathered; to shard them one by one, keep the tied weight inside one unit "
        "(return a module holding both ends from sharding_units())"
    ]
    assert not first["tied ddp log"] and not second["tied fsdp log"]  # rank zero logs; ddp has no units
    assert first["tied fsdp parameters"] == first["tied ddp parameters"]
    assert max_difference(first["tied ddp"], first["tied fsdp"]) <= 1e-5


def test_a_model_built_on_the_meta_device_starts_in_a_shard_of_its_memory_and_trains_as_built_normally(runs, tmp_path):
    """Every rank built the whole model before it was sharded; now each allocates its shard."""
    first, second = runs
    size = sum(t.numel() * t.element_size() for t in first["wide normal"].values())
    for rank in (first, second):
        assert rank["wide normal peak"] > size  # built whole, then sharded
        for build in ("meta", "hook"):
            assert rank[f"wide {build} peak"] < 0.75 * size, (build, rank[f"wide {build} peak"], size)
            assert max_difference(rank[f"wide {build}"], first["wide normal"]) <= 1e-6, build
    for build in ("meta", "hook", "normal"):  # one process: the same layers, drawn from the same seed
        module = WideModule(build)
        args = arguments("sp", str(tmp_path / build), epochs=1, max_steps=2)
        args.checkpointer_args = DefaultCheckpointerArguments(period=0, save_at_end=False)
        Trainer(module, args).train()
        assert max_difference(state_of(module), first["wide normal"]) <= 1e-5, build
