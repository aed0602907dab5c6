"""A pipeline of 2 stages on 2 real gloo ranks (:class:`~backends.strategies.pipeline_schedule.PipelineRunner`)
trains a Llama-style model as one process does: 4 micro-batches per step (the accumulation cycle, each
loss divided by 4), clipping that bites over both stages (``pipeline_group``), AdamW, 3 steps, with
``GPipe`` and ``1F1B``. Each rank also runs the one-process reference (the whole model, the same loop)."""

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from staged_llama import StagedLlama, token_loss

from distributed import run_ranks

from backends.strategies.gradient_clipping import clip_gradients
from backends.strategies.pipeline_schedule import PipelineRunner, schedule_class
from backends.strategies.pipeline_stages import default_stages, keep_stage

STEPS, MICRO_BATCHES, MAX_NORM = 3, 4, 0.3


def batches() -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (8, 9), generator=generator) for _ in range(STEPS)]


def reference() -> Dict[str, Any]:
    """The whole model, micro-batch by micro-batch, as the framework's automatic step trains it."""
    model = StagedLlama(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches():
        for chunk in tokens.chunk(MICRO_BATCHES):
            loss = token_loss(model(chunk[:, :-1]), chunk[:, 1:])
            (loss / MICRO_BATCHES).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": dict(model.named_parameters()), "losses": losses, "norm": float(norm)}


def pipelined(rank: int, schedule: str) -> Dict[str, Any]:
    model = StagedLlama(4)
    stage = copy.deepcopy(model)
    keep_stage(stage, default_stages(model, 2)[rank])
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    runner = PipelineRunner(stage, rank, 2, torch.device("cpu"), dist.group.WORLD, schedule, MICRO_BATCHES, token_loss)
    losses: List[float] = []
    norm = None
    for tokens in batches():
        losses += [loss.item() for loss in runner.step((tokens[:, :-1],), tokens[:, 1:])]
        norm = clip_gradients(list(stage.parameters()), MAX_NORM, pipeline_group=dist.group.WORLD)
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": dict(stage.named_parameters()), "losses": losses, "norm": float(norm)}


def schedule_scenarios(rank: int) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    results = {"reference": reference() if rank == 0 else None}
    for schedule in ("GPipe", "1F1B"):
        results[schedule] = pipelined(rank, schedule)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(schedule_scenarios, timeout=240)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_two_stages_train_as_one_process_in_weights_losses_and_clipped_norm(runs, schedule):
    """Faults: the last micro-batch's loss (or every one) not divided by the cycle (mutant:
    ``_scaled_loss`` returning ``loss``: gradients 4x, the clipped norm and the weights differ);
    gradients scaled twice (mutant: ``scale_grads=True``); clipping by the stage's own norm (mutant:
    no ``pipeline_group``: the norms differ per stage)."""
    expected = runs[0]["reference"]
    assert expected["norm"] > MAX_NORM  # clipping bites
    held = []
    for rank, result in enumerate(runs):
        got = result[schedule]
        assert got["norm"] == pytest.approx(expected["norm"], rel=1e-5), rank
        for name, weight in got["weights"].items():
            assert (weight - expected["weights"][name]).abs().max().item() <= 1e-5, (rank, name)
        held += list(got["weights"])
    assert sorted(held) == sorted(expected["weights"])  # the stages hold the whole model between them
    assert runs[0][schedule]["losses"] == []  # the loss exists on the last stage only
    assert runs[1][schedule]["losses"] == pytest.approx(expected["losses"], abs=1e-5)


def test_schedules_that_need_several_stages_per_rank_or_do_not_exist_are_refused_by_name():
    """Fault: an interleaved schedule accepted with one stage per rank (mutant: no ``PipelineScheduleSingle`` check)."""
    assert schedule_class("1f1b").__name__ == "Schedule1F1B"
    with pytest.raises(ValueError, match=r"'Interleaved1F1B' runs several stages on each rank.*allowed: \['GPipe', '1F1B'\]"):
        schedule_class("Interleaved1F1B")
    with pytest.raises(ValueError, match=r"'2F2B' is not one of torch's pipeline schedules; allowed: \['GPipe', '1F1B'\]"):
        schedule_class("2F2B")
