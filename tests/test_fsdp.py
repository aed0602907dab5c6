"""The ``fsdp`` backend (FSDP2) on 2 real gloo ranks: parity with ``ddp``, sharded state,
sharded checkpoints that resume on another world size, full-weight exports, and compile.

One 2-rank run (``two_rank_scenarios``) trains every 2-rank scenario (mixed precision and tied
blocks included) in the same process group; single-rank runs happen in the test process.
"""

import logging
import math
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from tiny_transformer import TinyTransformer
from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments

EPOCHS, STEPS_PER_EPOCH = 2, 4  # 64 samples / global batch 16
STOP_AT = 3  # mid-epoch: resume must land inside epoch 1


def arguments(backend: str, out: str, **overrides) -> TrainerArguments:
    """Global batch 16, micro-batch 4: accumulation 2 on 2 ranks (4 on 1); clipping that bites."""
    values = dict(
        epochs=EPOCHS,
        train_batch_size=16,
        gpu_batch_size_limit=4,
        backend=backend,
        clip_grads=True,
        max_grad_norm=0.2,
        disable_tqdm=True,
        output_dir=out,
        log_every_n_steps=2,
        sanity_val_steps=0,
        track_grad_norm=True,
    )
    values.update(overrides)
    args = TrainerArguments(**values)
    args.checkpointer_args.save_dir = os.path.join(out, "checkpoints")
    return args


def full_weights(trainer: Trainer) -> dict:
    state = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def local_numel(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors)


def two_rank_scenarios(rank: int, out: str, one_rank_dir: str) -> dict:
    dist.init_process_group("gloo")
    results = {}
    ddp = Trainer(TinyTransformer(), arguments("ddp", os.path.join(out, "ddp")))
    ddp.train()
    results["ddp"] = full_weights(ddp)
    results["ddp_val_loss"] = ddp.history.latest("val_loss")

    fsdp = Trainer(TinyTransformer(), arguments("fsdp", os.path.join(out, "fsdp")))
    fsdp.train()
    results["fsdp"] = full_weights(fsdp)
    results["fsdp_val_loss"] = fsdp.history.latest("val_loss")
    results["grad_norms"] = (ddp.history.latest("grad_norm"), fsdp.history.latest("grad_norm"))
    optimizer_state = [value for state in fsdp.optimizers[0].state.values() for value in state.values() if value.dim() > 0]
    results["parameters"] = (local_numel(fsdp.module.parameters()), sum(p.numel() for p in fsdp.module.parameters()))
    results["optimizer_state"] = (local_numel(optimizer_state), sum(t.numel() for t in optimizer_state))
    results["export"] = fsdp.save_model_checkpoint()
    results["checkpointer"] = type(fsdp.checkpointer).__name__
    try:  # a program needs the whole module, which no rank holds
        fsdp.export(os.path.join(out, "model.pt2"), (torch.zeros(2, 8, dtype=torch.long),))
        results["program_export"] = "exported"
    except NotImplementedError as error:
        results["program_export"] = str(error)

    stopped_args = arguments("fsdp", os.path.join(out, "stopped"), max_steps=STOP_AT)
    stopped_args.checkpointer_args.async_save, stopped_args.checkpointer_args.save_every_n_steps = True, 1
    stopped_args.checkpointer_args.keep_last_n = 2
    stopped = Trainer(TinyTransformer(), stopped_args)
    stopped.train()  # background saves at steps 1, 2, 3 (the last one kept twice), written by both ranks

    grown = Trainer(
        TinyTransformer(),
        arguments(
            "fsdp",
            one_rank_dir,
            checkpointer_args=DefaultCheckpointerArguments(save_dir=os.path.join(one_rank_dir, "checkpoints"), resume="auto"),
        ),
    )
    grown.args.checkpointer_args.save_dir = os.path.join(one_rank_dir, "checkpoints")
    grown.train()  # resumes the 1-rank checkpoint on 2 ranks
    results["grown"] = full_weights(grown)
    results["grown_step"] = grown.global_steps_finished
    results.update(mixed_precision_runs(os.path.join(out, "amp")))
    results["tied"] = paired_runs(os.path.join(out, "tied"), net="tied", backends=("ddp", "fsdp"))
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp"))
    one_rank_dir = os.path.join(out, "one-rank")
    Trainer(TinyTransformer(), arguments("fsdp", one_rank_dir, max_steps=STOP_AT)).train()  # 1 rank, stops at step 3
    results = run_ranks(two_rank_scenarios, out=out, one_rank_dir=one_rank_dir, timeout=240)
    return out, results


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


@pytest.mark.distributed
def test_fsdp_matches_ddp_with_accumulation_clipping_and_scheduler(runs):
    _, (rank0, rank1) = runs
    assert max_difference(rank0["ddp"], rank0["fsdp"]) <= 1e-5
    assert max_difference(rank0["fsdp"], rank1["fsdp"]) == 0  # the gathered weights are the same everywhere
    assert rank0["fsdp_val_loss"] == pytest.approx(rank0["ddp_val_loss"], abs=1e-5)
    ddp_norm, fsdp_norm = rank0["grad_norms"]
    assert fsdp_norm == pytest.approx(ddp_norm, rel=1e-5) and fsdp_norm > 0.2  # norms over all shards; clipping bit


@pytest.mark.distributed
def test_each_rank_holds_half_of_parameters_and_optimizer_state(runs):
    _, ranks = runs
    for result in ranks:
        for local, total in (result["parameters"], result["optimizer_state"]):
            assert abs(local - total / 2) <= 0.05 * total, (local, total)
    assert sum(r["parameters"][0] for r in ranks) >= ranks[0]["parameters"][1]  # together: everything (padding aside)
    assert ranks[0]["checkpointer"] == "DefaultCheckpointer"  # one checkpointer; the strategy writes shards


@pytest.mark.distributed
def test_sharded_checkpoint_layout_and_full_weight_export(runs):
    out, (rank0, rank1) = runs
    directory = os.path.join(out, "fsdp", "checkpoints", f"checkpoint-{EPOCHS * STEPS_PER_EPOCH:09d}")
    files = set(os.listdir(directory))
    assert {"state.pt", ".complete", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= files
    assert rank1["export"] is None and rank0["export"].endswith(f"model-{EPOCHS * STEPS_PER_EPOCH:09d}.pt")
    exported = torch.load(rank0["export"], weights_only=True)["model"]  # no process group needed
    assert max_difference(exported, rank0["fsdp"]) == 0
    inference = TinyTransformer()
    inference.load_state_dict(exported)  # a plain module takes the full weights
    for rank in (rank0, rank1):
        assert "export_weights('model.safetensors')" in rank["program_export"]  # the way that works is named


@pytest.mark.distributed
def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    out, (rank0, _) = runs
    stopped = os.path.join(out, "stopped")
    args = arguments("fsdp", stopped)
    args.checkpointer_args.resume = "auto"
    saved = sorted(name for name in os.listdir(os.path.join(stopped, "checkpoints")) if name.startswith("checkpoint-"))
    assert saved[0] == f"checkpoint-{STOP_AT - 1:09d}"  # the stopped run's keep_last_n=2 removed step 1's directory
    trainer = Trainer(TinyTransformer(), args)
    trainer.train()
    assert trainer.checkpointer.loaded_from.endswith(f"checkpoint-{STOP_AT:09d}")
    assert trainer.global_steps_finished == EPOCHS * STEPS_PER_EPOCH
    assert max_difference(full_weights(trainer), rank0["fsdp"]) <= 1e-5


@pytest.mark.distributed
def test_one_rank_checkpoint_resumes_on_two_ranks(runs):
    _, (rank0, rank1) = runs
    assert rank0["grown_step"] == EPOCHS * STEPS_PER_EPOCH
    assert max_difference(rank0["grown"], rank0["fsdp"]) <= 1e-5
    assert max_difference(rank0["grown"], rank1["grown"]) == 0


class Collect(logging.Handler):
    """The framework's log handler writes to the stderr of the first test that configured it: collect here."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def test_incomplete_or_damaged_sharded_checkpoint_falls_back_with_a_warning(tmp_path):
    out = str(tmp_path)
    args = arguments("fsdp", out, max_steps=3, track_grad_norm=False)
    args.checkpointer_args.save_every_n_steps = 1
    Trainer(TinyTransformer(), args).train()
    checkpoints = os.path.join(out, "checkpoints")
    os.remove(os.path.join(checkpoints, f"checkpoint-{3:09d}", ".complete"))  # killed before the save finished
    with open(os.path.join(checkpoints, f"checkpoint-{2:09d}", "state.pt"), "r+b") as handle:
        handle.truncate(100)  # damaged
    args = arguments("fsdp", out, max_steps=3, track_grad_norm=False)
    args.checkpointer_args.resume = "auto"
    trainer, collect = Trainer(TinyTransformer(), args), Collect()
    logging.getLogger("framework").addHandler(collect)
    try:
        trainer.train()
    finally:
        logging.getLogger("framework").removeHandler(collect)
    assert trainer.checkpointer.loaded_from.endswith(f"checkpoint-{1:09d}")
    skipped = [message for message in collect.messages if "was skipped" in message]
    assert len(skipped) == 2 and "no .complete marker" in skipped[0] and "truncated" in skipped[1]


def test_compile_matches_eager(tmp_path):
    """One rank, one block, two steps: compile is slow on CPU (the 2-rank fsdp compile is in benchmarks/fsdp.py)."""
    backend, weights, messages = "fsdp", {}, []
    for compile in (False, True):
        args = arguments(backend, str(tmp_path / f"{compile}"), max_steps=2, epochs=1, compile=compile, track_grad_norm=False)
        trainer, collect = Trainer(TinyTransformer(depth=1), args), Collect()
        loggers = [logging.getLogger("backends"), logging.getLogger("framework")]
        for logger in loggers:
            logger.addHandler(collect)
        try:
            trainer.train()
        finally:
            for logger in loggers:
                logger.removeHandler(collect)
        weights[compile] = full_weights(trainer)
        messages.extend(collect.messages)
    assert max_difference(weights[False], weights[True]) <= 1e-4  # inductor's fused kernels round differently
    assert sum("torch.compile: first training step" in message for message in messages) == 1


def mixed_precision_runs(out: str) -> dict:
    """``ddp-amp`` and ``fsdp-amp`` in the current process group: full weights, losses, parameter dtypes."""
    results = {}
    for backend in ("ddp-amp", "fsdp-amp"):
        trainer = Trainer(TinyTransformer(), arguments(backend, os.path.join(out, backend)))
        trainer.train()
        results[backend] = full_weights(trainer)
        results[f"{backend} losses"] = trainer.history.values("train_loss")
        results[f"{backend} dtypes"] = sorted({str(p.dtype) for p in trainer.module.parameters()})
    return results


class NormedBlocks(torch.nn.Module):
    """Blocks of Linear + BatchNorm1d in a ModuleList (each block a unit, its norm inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh()) for width in (16, 32)
        )
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedBlocks(torch.nn.Module):
    """Two blocks (two FSDP units) sharing one weight, as ALBERT shares its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)])
        self.blocks[1].weight = self.blocks[0].weight
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


NETS = {"normed": NormedBlocks, "tied": TiedBlocks}


class ToyWithNet(ToyModule):
    def __init__(self, net: str) -> None:
        super().__init__(n_train=64)
        torch.manual_seed(0)
        self.net = NETS[net]()


def paired_runs(out: str, net: str, backends: tuple) -> dict:
    """Train ``ToyWithNet(net)`` with each backend in the current process group: full weights, losses,
    and whether every tied parameter is still one parameter."""
    results = {}
    for backend in backends:
        trainer = Trainer(ToyWithNet(net), arguments(backend, os.path.join(out, backend)))
        trainer.train()
        results[backend] = full_weights(trainer)
        results[f"{backend} losses"] = trainer.history.values("train_loss")
        names = list(trainer.module.named_parameters(remove_duplicate=False))
        results[f"{backend} parameters"] = (len(list(trainer.module.parameters())), len(names))
    return results


@pytest.mark.distributed
def test_fsdp_shards_blocks_with_tied_weights_together_and_matches_ddp(runs):
    """FSDP2 refused the model ("shared with a parameter already managed by another FSDP group");
    units sharing a parameter are now one group."""
    for results in (rank["tied"] for rank in runs[1]):
        assert results["fsdp parameters"] == results["ddp parameters"] == (7, 8)  # 8 names, 7 parameters: still tied
        assert max_difference(results["ddp"], results["fsdp"]) < 1e-5


@pytest.mark.distributed
def test_fsdp_amp_trains_in_bf16_with_fp32_master_weights_close_to_ddp_amp(runs):
    results = runs[1][0]
    assert results["fsdp-amp dtypes"] == ["torch.float32"]  # the sharded master weights stay fp32
    assert all(math.isfinite(loss) for loss in results["fsdp-amp losses"])
    assert results["fsdp-amp losses"][-1] < results["fsdp-amp losses"][0]
    # bf16 compute on both sides (FSDP's param cast vs autocast): close, not equal.
    assert max_difference(results["ddp-amp"], results["fsdp-amp"]) < 5e-2


def test_a_timeout_under_fsdp_names_units_that_not_every_rank_runs():
    from backends.strategies.fsdp import FSDP

    strategy = FSDP(timeout_seconds=5, use_gpu=False)
    strategy.world_size = 2  # as after setup on 2 ranks
    message = strategy.explain_failure(RuntimeError("[Gloo] Timed out waiting 5000ms for recv operation"))
    assert "ddp_timeout=5s" in message and "sharding_units()" in message and "one expert" in message
