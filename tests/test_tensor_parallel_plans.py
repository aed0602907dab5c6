"""torchtitan's full tensor-parallel plan on a 1x2 mesh (2 gloo ranks): sequence-parallel norms
(their gradients are ``Partial`` DTensors), a row-split embedding, ``PrepareModuleInput`` and the
head; gradient norms and clipping against a hand-written DTensor computation and against ``sp``.

One 2-rank process group runs every scenario (``pair_scenarios``); the ``sp`` references run in
the test process. Tolerance: 1e-5 (fp32; row-split layers sum partial products in another order).
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distributed import run_ranks

from backends.strategies.gradient_clipping import clip_gradients, total_grad_norm
from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from model_parallel import LlamaArguments, TinyLlama

sys.path.pop(0)

SAMPLES, BATCH, EPOCHS = 32, 8, 1  # 4 steps
TOLERANCE = 1e-5
CONFIG = LlamaArguments(
    vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=32, seq_len=8, samples=SAMPLES, learning_rate=3e-3
)


def titan_plan() -> dict:
    """torchtitan's llama plan (``parallelize_llama``'s ``apply_tp``), norms sequence-parallel."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


class TitanLlama(TinyLlama):
    """The example's llama with torchtitan's full plan; records each step's loss and (manual) norms."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(CONFIG)
        self.losses, self.norms = [], []

    def tensor_parallel_plan(self) -> dict:
        return titan_plan()

    def get_train_dataloader(self, sampler, batch_size):
        from torch.utils.data import DataLoader

        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds, shuffle=False))

    def train_step(self, global_step, batch, device):
        loss = self.loss(batch)
        self.losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item())
        return loss


class TiedTitanLlama(TitanLlama):
    """Input and output embeddings one parameter (``output.weight = tok_embeddings.weight``)."""

    def __init__(self, head_style=None) -> None:
        super().__init__()
        self.output.weight = self.tok_embeddings.weight
        self.head_style = head_style

    def tensor_parallel_plan(self) -> dict:
        plan = titan_plan()
        if self.head_style is not None:
            plan["output"] = self.head_style
        return plan


class LossParallelLlama(TitanLlama):
    """torchtitan's loss-parallel recipe: the head leaves vocabulary-sharded logits (a ``Shard(-1)`` DTensor) and
    the loss is cross entropy on them, which needs ``loss_parallel()`` around forward and backward."""

    uses_loss_parallel = True

    def val_step(self, global_step, batch, device):
        loss = self.loss(batch)  # a DTensor: logged whole
        self.log("val_loss", loss.full_tensor(), batch_size=batch[0].shape[0])
        return loss

    def tensor_parallel_plan(self) -> dict:
        plan = titan_plan()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        return plan


def hand_written_loss_parallel(steps: int) -> dict:
    """The 2-D loop torchtitan runs (tp of 2, no dp): the plan by hand, forward and backward in
    ``loss_parallel()``, AdamW; the data in order. Returns its per-step losses and whole weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    model = LossParallelLlama()
    parallelize_module(model, init_device_mesh("cpu", (2,)), model.tensor_parallel_plan())
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG.learning_rate)
    tokens, losses = model.train_ds.tensors[0], []
    for step in range(steps):
        with loss_parallel():
            loss = model.loss([tokens[step * BATCH : (step + 1) * BATCH]])
            loss.backward()
        losses.append(loss.full_tensor().item())
        optimizer.step()
        optimizer.zero_grad()
    weights = {
        name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor for name, tensor in model.state_dict().items()
    }
    return {"losses": losses, "weights": weights}


class ManualTitanLlama(TitanLlama):
    automatic_optimization = False

    def train_step(self, global_step, batch, device):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.norms.append(float(self.clip_gradients(optimizer, max_norm=0.3)))
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()


def arguments(out: str, backend: str = "model-parallel", **overrides) -> TrainerArguments:
    values = dict(
        epochs=EPOCHS,
        train_batch_size=BATCH,
        backend=backend,
        clip_grads=True,
        max_grad_norm=0.3,  # bites: the norm is about 0.6
        track_grad_norm=True,
        disable_tqdm=True,
        output_dir=out,
        loggers=[],
        model_summary=False,
        log_every_n_steps=1,
        log_level="WARNING",
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
    )
    values.update(overrides)
    return TrainerArguments(**values)


def train(module: TitanLlama, args: TrainerArguments) -> dict:
    trainer = Trainer(module, args)
    history = trainer.train()
    state = trainer.backend.unsharded(trainer.module.state_dict())
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in state.items()},
        "losses": list(module.losses),
        "norms": list(module.norms) or [r["value"] for r in history.records if r["name"] == "grad_norm"],
        "val_loss": history.latest("val_loss"),
    }


def hand_written_norm(parameters, norm_type: float = 2.0) -> torch.Tensor:
    """Every gradient made whole (``full_tensor``: shards gathered, pending sums summed), then torch's norm."""
    whole = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in parameters]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in whole]), norm_type)


def placement_norms(rank: int) -> list:
    """Hand-made DTensor gradients of every placement (Shard, Replicate, Partial, mixed on a 2-D mesh) on
    meshes 2, 1x2 and 2x1: (mesh, norm_type, framework's norm, hand-written norm, norm clip_gradients returned,
    whole gradients before clipping, after)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"2": init_device_mesh("cpu", (2,)), "1x2": init_device_mesh("cpu", (1, 2)), "2x1": init_device_mesh("cpu", (2, 1))}
    layouts = {
        "2": [[Shard(0)], [Replicate()], [Partial()], [Shard(1)]],
        "1x2": [[Replicate(), Shard(0)], [Replicate(), Partial()], [Shard(0), Partial()], [Replicate(), Replicate()]],
        "2x1": [[Shard(0), Replicate()], [Partial(), Replicate()], [Partial(), Shard(0)]],
    }
    results = []
    for name, mesh in meshes.items():
        for norm_type in (2.0, float("inf")):
            parameters = []
            for index, placements in enumerate(layouts[name]):
                torch.manual_seed(index)
                whole = torch.randn(4, 6)
                parameter = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Replicate()] * mesh.ndim))
                if any(p.is_partial() for p in placements):  # each rank holds an unequal addend of ``whole``
                    addend = whole * (0.25 + 0.5 * dist.get_rank())
                    start = [Replicate() if p.is_partial() else p for p in placements]
                    local = distribute_tensor(addend, mesh, start, src_data_rank=None).to_local()  # this rank's addend
                    from torch.distributed.tensor import DTensor

                    parameter.grad = DTensor.from_local(local, mesh, placements, run_check=False)
                else:
                    parameter.grad = distribute_tensor(whole, mesh, placements)
                parameters.append(parameter)
            parameters.append(torch.nn.Parameter(torch.zeros(3)))  # a plain one beside them
            parameters[-1].grad = torch.full((3,), 0.5)
            expected = hand_written_norm(parameters, norm_type)
            measured = total_grad_norm(parameters, norm_type)
            wholes = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in parameters]
            if norm_type == 2.0:
                clipped = float(clip_gradients(parameters, max_norm=1.0))  # type: ignore[arg-type]
            else:  # by value: every element of the true (summed) gradient clamped
                clipped = float(clip_gradients(parameters, max_value=0.3) or "nan")
            after = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in parameters]
            results.append((name, norm_type, float(measured), float(expected), clipped, wholes, after))
    return results


def plan_norm(rank: int) -> tuple:
    """torchtitan's plan applied by hand on a 2-rank tp mesh, one backward: (framework's norm, hand-written)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = TitanLlama()
    parallelize_module(model, init_device_mesh("cpu", (2,)), titan_plan())
    model.loss(model.train_ds[:BATCH]).backward()
    partial = [name for name, p in model.named_parameters() if any(x.is_partial() for x in p.grad.placements)]
    return float(total_grad_norm(model.parameters())), float(hand_written_norm(model.parameters())), partial


def pair_scenarios(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {"placements": placement_norms(rank), "plan": plan_norm(rank)}
    results["automatic"] = train(TitanLlama(), arguments(os.path.join(out, "mp")))
    manual = arguments(os.path.join(out, "mp-manual"), clip_grads=False, track_grad_norm=False)
    results["manual"] = train(ManualTitanLlama(), manual)
    results["tied"] = train(TiedTitanLlama(), arguments(os.path.join(out, "mp-tied")))
    plain = dict(clip_grads=False, track_grad_norm=False)
    results["loss_parallel"] = train(LossParallelLlama(), arguments(os.path.join(out, "mp-loss-parallel"), **plain))
    results["loss_parallel_hand"] = hand_written_loss_parallel(SAMPLES // BATCH)
    try:  # the head split by input columns, the embedding by vocabulary rows: the tie cannot hold
        head = RowwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        Trainer(TiedTitanLlama(head), arguments(os.path.join(out, "mp-tie-refused"))).train()
    except ValueError as error:
        results["tie_refused"] = str(error)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp-plans"))
    pair = run_ranks(pair_scenarios, world_size=2, out=out, timeout=300)
    sp = train(TitanLlama(), arguments(os.path.join(out, "sp"), backend="sp"))
    manual = arguments(os.path.join(out, "sp-manual"), backend="sp", clip_grads=False, track_grad_norm=False)
    sp_manual = train(ManualTitanLlama(), manual)
    tied = train(TiedTitanLlama(), arguments(os.path.join(out, "sp-tied"), backend="sp"))
    plain = TitanLlama()
    plain.loss(plain.train_ds[:BATCH]).backward()
    return pair, sp, sp_manual, float(hand_written_norm(plain.parameters())), tied


@pytest.mark.distributed
@pytest.mark.slow
def test_norm_and_clipping_of_every_placement_match_the_hand_written_dtensor_computation(runs):
    """Catches: a Partial gradient counted once per rank it is pending on, a group's reduction skipped, or
    each rank's addend of a Partial gradient clamped by value instead of the sum."""
    pair, *_ = runs
    for result in pair:
        for name, norm_type, measured, expected, clipped, wholes, after in result["placements"]:
            assert measured == pytest.approx(expected, rel=1e-6), (name, norm_type)
            if norm_type != 2.0:  # clipped by value
                for before, now in zip(wholes, after):
                    torch.testing.assert_close(now, before.clamp(-0.3, 0.3), rtol=1e-6, atol=1e-7)
                continue
            assert clipped == pytest.approx(hand_written_norm_of(wholes), rel=1e-6), name
            for before, now in zip(wholes, after):
                torch.testing.assert_close(now, before * min(1.0, 1.0 / (clipped + 1e-6)), rtol=1e-5, atol=1e-7)


def hand_written_norm_of(wholes) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in wholes])))


@pytest.mark.distributed
@pytest.mark.slow
def test_titan_plan_norm_on_1x2_is_the_true_norm(runs):
    """Catches: the sequence-parallel norm weights' Partial gradients counted twice (0.6037 vs 0.5880)."""
    pair, _, _, sp_norm, _ = runs
    for result in pair:
        measured, expected, partial = result["plan"]
        assert "norm.weight" in partial and "layers.0.ffn_norm.weight" in partial  # the case under test is there
        assert measured == pytest.approx(expected, rel=1e-6)
        assert measured == pytest.approx(sp_norm, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_clipping_and_track_grad_norm_with_sequence_parallel_norms_match_sp(runs):
    """Catches: clip_grads / track_grad_norm and manual clip_gradients measuring Partial gradients per tp rank."""
    pair, sp, sp_manual, *_ = runs
    for result in pair:
        for mode, reference in (("automatic", sp), ("manual", sp_manual)):
            run = result[mode]
            assert len(run["norms"]) == SAMPLES // BATCH and min(run["norms"]) > 0.3, mode  # clipping bit
            assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5), mode
            assert run["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE), mode
            for name, tensor in reference["weights"].items():
                assert (run["weights"][name] - tensor).abs().max().item() <= TOLERANCE, (mode, name)


@pytest.mark.distributed
@pytest.mark.slow
def test_tied_embeddings_stay_one_parameter_under_the_tensor_parallel_plan(runs):
    """Catches: the plan giving the embedding and the head a DTensor each (the two ends train apart)."""
    pair, *_, sp_tied = runs
    for result in pair:
        run = result["tied"]
        assert torch.equal(run["weights"]["output.weight"], run["weights"]["tok_embeddings.weight"])
        for name, tensor in sp_tied["weights"].items():  # Adam turns a rounding difference in a near-zero gradient
            # element into up to 1.2e-5 of weight on some CPUs (measured here, at the base of 2026-11-27 too); the untied
            # fault is caught by the equality of the two ends above
            assert (run["weights"][name] - tensor).abs().max().item() <= 3 * TOLERANCE, name
        assert run["losses"] == pytest.approx(sp_tied["losses"], abs=TOLERANCE)
        assert run["val_loss"] == pytest.approx(sp_tied["val_loss"], abs=TOLERANCE)
        reloaded = TiedTitanLlama()  # the user's tied module takes the weights back and gives the run's val loss
        reloaded.load_state_dict(run["weights"])
        tokens = reloaded.val_ds.tensors[0]
        with torch.no_grad():
            assert float(reloaded.loss([tokens])) == pytest.approx(run["val_loss"], abs=TOLERANCE)
        refused = result["tie_refused"]
        assert "tok_embeddings.weight and output.weight are one tied parameter" in refused
        assert "Shard(dim=0)" in refused and "Shard(dim=1)" in refused


@pytest.mark.distributed
@pytest.mark.slow
def test_loss_parallel_recipe_runs_in_automatic_optimization_as_the_hand_written_2d_loop(runs):
    """Catches: backward outside loss_parallel() (aten.nll_loss_backward got mixed torch.Tensor and DTensor)."""
    pair, *_ = runs
    for result in pair:
        run, hand = result["loss_parallel"], result["loss_parallel_hand"]
        assert len(run["losses"]) == SAMPLES // BATCH
        assert run["losses"] == pytest.approx(hand["losses"], abs=TOLERANCE)
        for name, tensor in hand["weights"].items():
            assert (run["weights"][name] - tensor).abs().max().item() <= TOLERANCE, name
        assert run["val_loss"] is not None and run["val_loss"] < 4
