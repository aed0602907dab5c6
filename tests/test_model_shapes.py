"""Model shapes real users have, on every backend: a complex buffer under true bf16
(``backends/precision/precisions.py`` ``TrueBF16``) and blocks in an ``nn.ModuleDict`` as sharding units
(``backends/strategies/units.py``), with a torchtitan-style model (``tests/titan_transformer.py``).

The 2-rank checks share one process group (``two_rank_runs``).
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from logs import captured_log

from distributed import run_ranks
from titan_transformer import TitanTransformer, hand_written_true_bf16
from toy import ToyModule

from backends.strategies.units import default_units
from framework import Trainer, TrainerArguments

MICRO_BATCH = 4


def arguments(backend: str, out: str, world_size: int = 1) -> TrainerArguments:
    """One epoch over the 32 samples, micro-batches of 4, no accumulation."""
    return TrainerArguments(
        epochs=1,
        train_batch_size=MICRO_BATCH * world_size,
        backend=backend,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=out,
        sanity_val_steps=0,
    )


def trained_state(trainer: Trainer) -> dict:
    state = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def max_difference(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max((first[name].to(second[name].dtype) - second[name]).abs().max().item() for name in first)


def test_sp_bf16_keeps_a_complex_buffer_and_equals_a_hand_written_true_bf16_loop(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Casting complex values to real discards the imaginary part"
        trainer = Trainer(TitanTransformer(), arguments("sp-bf16", str(tmp_path)))
        trainer.train()
    state = trained_state(trainer)
    assert state["freqs_cis"].dtype == torch.complex64
    assert torch.equal(state["freqs_cis"], TitanTransformer().freqs_cis)
    assert {state[name].dtype for name in state if name != "freqs_cis"} == {torch.bfloat16}
    steps = len(trainer.module.train_ds) // MICRO_BATCH
    assert max_difference(state, hand_written_true_bf16(steps, MICRO_BATCH)) == 0


def test_blocks_in_a_module_dict_or_list_are_units():
    model = TitanTransformer(depth=3)
    model.metrics = torch.nn.ModuleDict({"relu": torch.nn.ReLU()})  # no parameters: not a unit
    assert default_units(model) == list(model.layers.values())
    nested = torch.nn.ModuleList([model])
    assert default_units(nested) == [model]  # lists inside a unit (a block's experts) are sharded with it


def scenarios(rank: int, out: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo")
    results = {}
    steps = len(TitanTransformer().train_ds) // (2 * MICRO_BATCH)
    results["hand bf16"] = hand_written_true_bf16(steps, MICRO_BATCH, rank=rank, world_size=2)
    for backend in ("ddp-bf16", "fsdp-bf16", "fsdp"):
        trainer = Trainer(TitanTransformer(), arguments(backend, os.path.join(out, backend), world_size=2))
        trainer.train()
        results[backend] = trained_state(trainer)
        results[f"{backend} units"] = [name for name, sub in trainer.module.named_modules() if isinstance(sub, FSDPModule)]
    with captured_log("backends") as messages:  # a model without blocks: one unit, and a message saying so
        args = arguments("fsdp", os.path.join(out, "no-units"), world_size=2)
        args.max_steps = 1
        Trainer(ToyModule(n_train=16, val_loaders=0), args).train()
    results["no units"] = list(messages)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return run_ranks(scenarios, out=str(tmp_path_factory.mktemp("shapes")), timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_bf16_and_fsdp_bf16_keep_the_complex_buffer_and_equal_the_hand_written_loop(two_rank_runs):
    first, second = two_rank_runs
    assert max_difference(first["hand bf16"], second["hand bf16"]) == 0
    for backend in ("ddp-bf16", "fsdp-bf16"):
        state = first[backend]
        assert state["freqs_cis"].dtype == torch.complex64, backend
        assert torch.equal(state["freqs_cis"], TitanTransformer().freqs_cis), backend
        assert max_difference(state, first["hand bf16"]) == 0, backend
        assert max_difference(second[backend], state) == 0, backend


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_shards_each_block_of_a_module_dict_as_its_own_unit_and_trains_as_sp(two_rank_runs, tmp_path):
    first, second = two_rank_runs
    assert [message for message in first["no units"] if "no sharding units" in message] == [
        "fsdp: ToyModule has no sharding units (sharding_units() returned none and it holds no nn.ModuleList or "
        "nn.ModuleDict blocks), so the whole model is one unit: every rank all-gathers all its parameters at once; "
        "define sharding_units() to return the blocks to shard one by one"
    ]
    assert not second["no units"]  # rank zero logs
    assert first["fsdp units"] == ["layers.0", "layers.1"]  # each block (the root unit is the step runner around it)
    sp = Trainer(TitanTransformer(), arguments("sp", str(tmp_path), world_size=2))
    sp.train()
    assert max_difference(first["fsdp"], trained_state(sp)) <= 1e-5, max_difference(first["fsdp"], trained_state(sp))
