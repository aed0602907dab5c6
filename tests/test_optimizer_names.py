"""Sharded checkpoints key optimizer state by parameter name (``state/<name>/exp_avg``), not by
position, on 2 real gloo ranks (``fsdp``: HSDP and ``model-parallel`` save through the same code).

One 2-rank run (``name_scenarios``) trains the model-parallel example's small llama with AdamW and
clipping that bites: an uninterrupted run (the reference), a run stopped mid-epoch that saves, and
three resumes of its checkpoint: as written; into a model whose parameters are registered in
another order (same names); and from the same checkpoint rewritten in the layout sharded
checkpoints had before names (``state/<position>/...``, built here from the new one). The test
process resumes the 2-rank checkpoint on one process (2 -> 1 rank) and checks the keys.
"""

import os
import sys
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

from backends.checkpoint_io import CheckpointIO, optimizer_names, sharded_checkpoint
from framework import Trainer, TrainerArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from model_parallel import LlamaArguments, TinyLlama

sys.path.pop(0)

SAMPLES, BATCH, EPOCHS = 32, 8, 2  # 4 steps per epoch, 8 in all
STOP_AT = 6
CONFIG = LlamaArguments(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=32, seq_len=8, samples=SAMPLES)


class Llama(TinyLlama):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(CONFIG)


class ReorderedLlama(Llama):
    """The same parameters under the same names, registered in another order (head first, embeddings
    last): the optimizer built from ``self.parameters()`` numbers every one of them differently."""

    def __init__(self) -> None:
        super().__init__()
        order = ["output", "norm", "layers", "tok_embeddings"]
        self._modules = {name: self._modules[name] for name in order + [n for n in self._modules if n not in order]}


def arguments(out: str, save: bool = False, load_from: str = "", **overrides: Any) -> TrainerArguments:
    values: Dict[str, Any] = dict(
        epochs=EPOCHS,
        train_batch_size=BATCH,
        gpu_batch_size_limit=2,
        backend="fsdp",
        clip_grads=True,
        max_grad_norm=0.3,
        log_every_n_steps=1,
        disable_tqdm=True,
        output_dir=out,
        loggers=[],
        model_summary=False,
    )
    values.update(overrides)
    args = TrainerArguments(**values)
    args.checkpointer_args.save_dir = os.path.join(out, "checkpoints")
    args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, save
    if load_from:
        args.checkpointer_args.load_dir = os.path.join(load_from, "checkpoints")
    return args


def summary(module: Any, args: TrainerArguments) -> Dict[str, Any]:
    trainer = Trainer(module, args)
    trainer.train()
    state = trainer.backend.unsharded(trainer.module.state_dict())
    return {
        "weights": {name: tensor.detach().clone() for name, tensor in state.items()},
        "train_loss": [(step, value) for step, value in trainer.history.steps("train_loss") if step > STOP_AT],
        "step": trainer.global_steps_finished,
    }


def checkpoint_in(out: str) -> str:
    checkpoints = os.path.join(out, "checkpoints")
    (name,) = [name for name in os.listdir(checkpoints) if name.startswith("checkpoint-")]
    return os.path.join(checkpoints, name)


def write_by_position(source: str, out: str) -> None:
    """``source``'s checkpoint rewritten as sharded checkpoints were before names: full tensors, written
    by one process, optimizer state numbered by position (``trainer/optimizers/0/state/3/exp_avg``)."""
    state = sharded_checkpoint.load(source, CheckpointIO())
    state["trainer"]["optimizers"] = [optimizer_names.by_position(saved) for saved in state["trainer"]["optimizers"]]
    target = os.path.join(out, "checkpoints", os.path.basename(source))
    os.makedirs(os.path.dirname(target))
    write = sharded_checkpoint.prepare_save(
        target, state, CheckpointIO(), is_main=True, distributed=False, on_rank_zero=lambda run, what: run()
    )
    write()


def name_scenarios(rank: int, out: str) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    results = {"reference": summary(Llama(), arguments(os.path.join(out, "reference")))}
    stopped = os.path.join(out, "stopped")
    summary(Llama(), arguments(stopped, save=True, max_steps=STOP_AT))
    results["resumed"] = summary(Llama(), arguments(os.path.join(out, "resumed"), load_from=stopped))
    results["reordered"] = summary(ReorderedLlama(), arguments(os.path.join(out, "reordered"), load_from=stopped))
    by_position = os.path.join(out, "by-position")
    if rank == 0:
        write_by_position(checkpoint_in(stopped), by_position)
    dist.barrier()
    results["by_position"] = summary(Llama(), arguments(os.path.join(out, "from-old"), load_from=by_position))
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("names"))
    results = run_ranks(name_scenarios, out=out, timeout=300)
    one_rank = summary(Llama(), arguments(os.path.join(out, "one-rank"), load_from=os.path.join(out, "stopped")))
    return out, results, one_rank


def max_difference(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


def logged_difference(first: list, second: list) -> float:
    assert [step for step, _ in first] == [step for step, _ in second] and first
    return max(abs(a - b) for (_, a), (_, b) in zip(first, second))


@pytest.mark.distributed
@pytest.mark.slow
def test_optimizer_state_is_keyed_by_parameter_name_and_resumes_bitwise(runs):
    """Fault: moments keyed by position (mutant: ``by_name`` returning ``optimizer.state_dict()``: the keys
    are numbers, and the reordered resume is refused: ``state/3/exp_avg (16, 16) in the checkpoint, (16,)
    in this run``), or a name mapped to another parameter's moments (the resume is not bitwise)."""
    out, results, _ = runs
    state = torch.load(os.path.join(checkpoint_in(os.path.join(out, "stopped")), "state.pt"), weights_only=True)
    saved = state["trainer"]["optimizers"][0]
    names = [name for name, _ in Llama().named_parameters()]
    assert list(saved["state"]) == names and saved["param_groups"][0]["params"] == names
    assert saved["state"]["output.weight"]["exp_avg"] == {"__sharded__": "trainer/optimizers/0/state/output.weight/exp_avg"}
    for rank, result in enumerate(results):
        expected = result["reference"]
        assert result["resumed"]["step"] == EPOCHS * SAMPLES // BATCH
        assert max_difference(result["resumed"]["weights"], expected["weights"]) == 0, rank
        assert result["resumed"]["train_loss"] == expected["train_loss"], rank


@pytest.mark.distributed
@pytest.mark.slow
def test_a_model_whose_parameters_are_registered_in_another_order_resumes_each_parameters_own_moments(runs):
    """Fault: state matched by position (mutant: ``load_into`` calling ``optimizer.load_state_dict`` on the
    name-keyed state numbered by the saved order): the head gets the embeddings' moments, AdamW fails on
    their shapes; same-shaped ones would silently train on with another parameter's moments)."""
    _, results, _ = runs
    assert next(name for name, _ in ReorderedLlama().named_parameters()) == "output.weight"
    for rank, result in enumerate(results):
        expected, reordered = result["reference"], result["reordered"]
        assert reordered["step"] == EPOCHS * SAMPLES // BATCH
        assert max_difference(reordered["weights"], expected["weights"]) <= 1e-6, rank  # the norm sums in another order
        assert logged_difference(reordered["train_loss"], expected["train_loss"]) <= 1e-6, rank


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_written_by_position_before_names_still_resumes(runs):
    """Fault: a checkpoint of the old layout unreadable or its moments dropped (mutant: ``aligned``
    leaving this run's state keyed by name: no moment is restored, AdamW fails on an empty tensor beside
    a DTensor)."""
    _, results, _ = runs
    for rank, result in enumerate(results):
        expected = result["reference"]
        assert result["by_position"]["step"] == EPOCHS * SAMPLES // BATCH
        assert max_difference(result["by_position"]["weights"], expected["weights"]) == 0, rank
        assert result["by_position"]["train_loss"] == expected["train_loss"], rank


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_rank_checkpoint_keyed_by_name_resumes_on_one_rank(runs):
    """Fault: name-keyed shards not resharded (mutant as the first test's: refused or not bitwise)."""
    _, results, one_rank = runs
    expected = results[0]["reference"]
    assert one_rank["step"] == EPOCHS * SAMPLES // BATCH
    assert max_difference(one_rank["weights"], expected["weights"]) <= 1e-5
    assert logged_difference(one_rank["train_loss"], expected["train_loss"]) <= 1e-5
