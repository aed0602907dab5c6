"""HSDP (``data_parallel_replicate_size``): parameters sharded within a replica group, gradients
all-reduced across groups, on a ``("dp_replicate", "dp_shard")`` mesh (``fsdp``) and a
``("dp_replicate", "dp_shard", "tp")`` mesh (``model-parallel``).

One 4-rank process group (``quad_scenarios``, the file's only one) trains HSDP 2x2, plain fsdp over
4 ranks and model-parallel HSDP 2x1x2, refuses bad sizes, stops an HSDP run mid-epoch and resumes
it on HSDP 2x2, as fsdp over 4 ranks (each parameter in quarters, not halves) and as model-parallel
2x2 (layers split over tp, then sharded over dp), and resumes fsdp's mid-epoch checkpoint under HSDP;
the ``sp`` reference runs in the test process. The model is the
model-parallel example's small llama (units: its blocks), with clipping that bites. Tolerance:
weights and logged losses within 1e-5 of ``sp`` and of fsdp (the gradient sums run in another
order); the resume on the layout that wrote the checkpoint is bitwise.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from distributed import run_ranks

from framework import Trainer, TrainerArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from model_parallel import LlamaArguments, TinyLlama

sys.path.pop(0)

SAMPLES, BATCH, EPOCHS = 32, 8, 2  # 4 steps per epoch, 8 in all
STOP_AT = 6  # mid-epoch 1: every resume lands inside an epoch
TOLERANCE = 1e-5
CONFIG = LlamaArguments(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=32, seq_len=8, samples=SAMPLES)


class RecordingLlama(TinyLlama):
    """The example's model; records which samples each step saw."""

    def __init__(self) -> None:
        torch.manual_seed(0)  # the same initial weights in every process
        super().__init__(CONFIG)
        tokens = self.train_ds.tensors[0]
        self.train_ds = TensorDataset(tokens, torch.arange(len(tokens)))
        self.seen: list = []

    def train_step(self, global_step, batch, device):
        self.seen.append((global_step, batch[1].tolist()))
        return self.loss(batch)


def arguments(out: str, backend: str = "fsdp", save: bool = False, **overrides) -> TrainerArguments:
    values = dict(
        epochs=EPOCHS,
        train_batch_size=BATCH,
        gpu_batch_size_limit=1,  # accumulation 2 per rank on 4 data-parallel ranks (no_sync under HSDP), 8 on sp
        backend=backend,
        clip_grads=True,
        max_grad_norm=0.3,
        track_grad_norm=True,
        log_every_n_steps=1,
        disable_tqdm=True,
        output_dir=out,
        loggers=[],
        model_summary=False,
    )
    values.update(overrides)
    args = TrainerArguments(**values)
    args.checkpointer_args.save_dir = os.path.join(out, "checkpoints")
    args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, save  # only the stopped run saves, at its end
    return args


def resumed_from(stopped: str, out: str, **overrides) -> TrainerArguments:
    args = arguments(out, **overrides)
    args.checkpointer_args.load_dir = os.path.join(stopped, "checkpoints")
    return args


def summary(trainer: Trainer) -> dict:
    state = trainer.backend.unsharded(trainer.module.state_dict())
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in state.items()},
        "seen": trainer.module.seen,
        "train_loss": trainer.history.steps("train_loss"),
        "grad_norm": trainer.history.steps("grad_norm"),
        "val_loss": trainer.history.latest("val_loss"),
        "step": trainer.global_steps_finished,
        "data_parallel": (trainer.backend.data_parallel_rank, trainer.backend.data_parallel_size),
    }


def refusal(out: str, **overrides) -> str:
    try:
        Trainer(RecordingLlama(), arguments(out, **overrides))
    except ValueError as error:
        return str(error)
    return "accepted"


def quad_scenarios(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {
        "bad_fsdp": refusal(os.path.join(out, "bad"), data_parallel_replicate_size=3),
        "bad_model_parallel": refusal(
            os.path.join(out, "bad"), backend="model-parallel", tensor_parallel_size=2, data_parallel_replicate_size=4
        ),
    }
    hsdp = Trainer(RecordingLlama(), arguments(os.path.join(out, "hsdp"), data_parallel_replicate_size=2))
    hsdp.train()
    weight = hsdp.module.layers[0].attention.wq.weight
    results["mesh"] = (weight.device_mesh.mesh_dim_names, weight.device_mesh.mesh.tolist(), tuple(map(repr, weight.placements)))
    results["local_rows"] = (weight.to_local().shape[0], weight.shape[0])
    results["hsdp"] = summary(hsdp)
    fsdp = arguments(os.path.join(out, "fsdp"))
    fsdp.checkpointer_args.save_every_n_steps = STOP_AT  # its one checkpoint, resumed under HSDP below
    results["fsdp"] = summary(_trained(fsdp))
    split = arguments(os.path.join(out, "mp"), backend="model-parallel", tensor_parallel_size=2, data_parallel_replicate_size=2)
    model_parallel = _trained(split)
    weight = model_parallel.module.layers[0].attention.wq.weight
    results["mp_mesh"] = (weight.device_mesh.mesh_dim_names, weight.device_mesh.mesh.tolist())
    results["mp"] = summary(model_parallel)
    stopped = os.path.join(out, "stopped")
    _trained(arguments(stopped, save=True, data_parallel_replicate_size=2, max_steps=STOP_AT))
    results["as_hsdp"] = summary(_trained(resumed_from(stopped, os.path.join(out, "as-hsdp"), data_parallel_replicate_size=2)))
    results["as_fsdp"] = summary(_trained(resumed_from(stopped, os.path.join(out, "as-fsdp"))))
    from_fsdp = resumed_from(os.path.join(out, "fsdp"), os.path.join(out, "from-fsdp"), data_parallel_replicate_size=2)
    results["from_fsdp"] = summary(_trained(from_fsdp))
    as_2x2 = resumed_from(stopped, os.path.join(out, "as-2x2"), backend="model-parallel", tensor_parallel_size=2)
    results["as_2x2"] = summary(_trained(as_2x2))
    dist.destroy_process_group()
    return results


def _trained(args: TrainerArguments) -> Trainer:
    trainer = Trainer(RecordingLlama(), args)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hsdp"))
    reference = summary(_trained(arguments(os.path.join(out, "sp"), backend="sp")))
    return reference, run_ranks(quad_scenarios, world_size=4, out=out, timeout=400)


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


def after_stop(logged: list) -> list:
    """The values logged at the steps after the stopped run's last (a resumed run's history holds both)."""
    return [(step, value) for step, value in logged if step > STOP_AT]


def logged_difference(first: list, second: list) -> float:
    assert [step for step, _ in first] == [step for step, _ in second] and first
    return max(abs(a - b) for (_, a), (_, b) in zip(first, second))


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_2x2_and_model_parallel_hsdp_match_fsdp_and_sp_in_weights_and_logged_losses(runs):
    sp, quad = runs
    assert len(sp["train_loss"]) == EPOCHS * SAMPLES // BATCH
    assert min(norm for _, norm in sp["grad_norm"]) > 0.3  # clipping bites at every step
    for name in ("hsdp", "fsdp", "mp"):
        for rank, result in enumerate(quad):
            run = result[name]
            assert max_difference(run["weights"], sp["weights"]) <= TOLERANCE, (name, rank)
            assert logged_difference(run["train_loss"], sp["train_loss"]) <= TOLERANCE, (name, rank)
            assert logged_difference(run["grad_norm"], sp["grad_norm"]) <= TOLERANCE, (name, rank)
            assert run["val_loss"] == pytest.approx(sp["val_loss"], abs=TOLERANCE), (name, rank)
    assert max_difference(quad[0]["hsdp"]["weights"], quad[0]["fsdp"]["weights"]) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
def test_every_replica_shard_pair_reads_its_own_share_and_tp_peers_the_same(runs):
    _, quad = runs
    assert [result["hsdp"]["data_parallel"] for result in quad] == [(rank, 4) for rank in range(4)]
    assert [result["mp"]["data_parallel"] for result in quad] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for name, readers in (("hsdp", (0, 1, 2, 3)), ("mp", (0, 2))):
        for epoch in range(EPOCHS):
            steps = range(epoch * SAMPLES // BATCH, (epoch + 1) * SAMPLES // BATCH)
            shares = [[i for step, batch in quad[rank][name]["seen"] if step in steps for i in batch] for rank in readers]
            assert sorted(i for share in shares for i in share) == list(range(SAMPLES)), (name, epoch)  # each sample once
    assert quad[0]["mp"]["seen"] == quad[1]["mp"]["seen"] and quad[2]["mp"]["seen"] == quad[3]["mp"]["seen"]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_mesh_is_two_dimensional_sharded_within_consecutive_ranks_replicated_across(runs):
    _, quad = runs
    names, ranks, placements = quad[0]["mesh"]
    assert names == ("dp_replicate", "dp_shard")
    assert ranks == [[0, 1], [2, 3]]  # a replica group is consecutive ranks: one node under torchrun
    assert placements == ("Replicate()", "Shard(dim=0)")
    assert [result["local_rows"] for result in quad] == [(8, 16)] * 4  # half of each weight per rank, not a quarter
    assert quad[0]["mp_mesh"] == (("dp_replicate", "dp_shard", "tp"), [[[0, 1]], [[2, 3]]])


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_checkpoints_resume_bitwise_on_hsdp_and_reshard_to_fsdp_and_model_parallel_and_back(runs):
    _, quad = runs
    expected = quad[0]["hsdp"]
    for rank, result in enumerate(quad):
        resumed = result["as_hsdp"]
        assert resumed["seen"][0][0] == STOP_AT and resumed["step"] == EPOCHS * SAMPLES // BATCH
        assert max_difference(resumed["weights"], expected["weights"]) == 0, rank  # same layout: bitwise
        assert after_stop(resumed["train_loss"]) == after_stop(expected["train_loss"]), rank
    for name in ("as_fsdp", "as_2x2"):
        for rank, result in enumerate(quad):
            resumed = result[name]
            assert resumed["seen"][0][0] == STOP_AT and resumed["step"] == EPOCHS * SAMPLES // BATCH, (name, rank)
            assert max_difference(resumed["weights"], expected["weights"]) <= TOLERANCE, (name, rank)
            losses = after_stop(resumed["train_loss"]), after_stop(expected["train_loss"])
            assert logged_difference(*losses) <= TOLERANCE, (name, rank)
    for rank, result in enumerate(quad):  # and the other way: fsdp's checkpoint resumed under HSDP
        resumed, uninterrupted = result["from_fsdp"], result["fsdp"]
        assert resumed["seen"][0][0] == STOP_AT and resumed["step"] == EPOCHS * SAMPLES // BATCH, rank
        assert max_difference(resumed["weights"], uninterrupted["weights"]) <= TOLERANCE, rank
        assert logged_difference(after_stop(resumed["train_loss"]), after_stop(uninterrupted["train_loss"])) <= TOLERANCE, rank


@pytest.mark.distributed
@pytest.mark.slow
def test_a_replicate_size_that_does_not_divide_the_data_parallel_ranks_is_refused_before_training(runs):
    _, quad = runs
    for result in quad:
        assert "data_parallel_replicate_size=3 does not divide the data-parallel size 4" in result["bad_fsdp"]
        assert "[1, 2, 4]" in result["bad_fsdp"]
        assert "data_parallel_replicate_size=4 does not divide the data-parallel size 2" in result["bad_model_parallel"]
        assert "tensor_parallel_size 2" in result["bad_model_parallel"]


def test_replicate_size_on_backends_without_sharding_and_invalid_values_are_refused(tmp_path):
    for backend in ("sp", "ddp"):
        with pytest.raises(ValueError, match=r"data_parallel_replicate_size=2 does not apply to backend.*fsdp"):
            Trainer(RecordingLlama(), TrainerArguments(backend=backend, data_parallel_replicate_size=2, output_dir=str(tmp_path)))
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"data_parallel_replicate_size={bad} is invalid"):
            TrainerArguments(backend="fsdp", data_parallel_replicate_size=bad)
    with pytest.raises(ValueError, match="data_parallel_replicate_size=2 does not divide the data-parallel size 1"):
        Trainer(RecordingLlama(), TrainerArguments(backend="fsdp", data_parallel_replicate_size=2, output_dir=str(tmp_path)))
