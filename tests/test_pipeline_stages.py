"""Cutting a Llama-style model (embeddings, blocks, norm, head) into pipeline stages: the default
split, a module's own ``pipeline_stages``, names kept, and the stages run in turn equal the whole model."""

import copy

import pytest
import torch
from staged_llama import StagedLlama

from backends.strategies.pipeline_stages import check_stages, default_stages, keep_stage, top_level_names


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (4, 2, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]),
        (5, 2, [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "norm", "output"]]),
        (4, 4, [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]),
        (3, 1, [["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]]),
    ],
)
def test_the_default_split_gives_each_stage_its_share_of_blocks_and_the_ends_to_the_first_and_last(layers, stages, expected):
    """Fault: blocks lost or misplaced when they do not divide (mutant: ``size = len(blocks) // num_stages``:
    5 blocks on 2 stages leave layers.4 on none)."""
    split = default_stages(StagedLlama(layers), stages)
    assert split == expected
    check_stages(StagedLlama(layers), split, stages)


@pytest.mark.parametrize("blocks", ["list", "dict"])
def test_each_stage_keeps_its_parameters_names_and_the_stages_in_turn_compute_the_whole_model(blocks):
    """Fault: a stage that renames its parameters (mutant: kept blocks rebuilt as a new ``nn.ModuleList``:
    layers.2 becomes layers.0 on stage 1, and a checkpoint keyed by name no longer matches) or holds
    another stage's parts (mutant: ``keep_stage`` keeping every child)."""
    model = StagedLlama(4, blocks)
    whole = [name for name, _ in model.named_parameters()]
    tokens = torch.randint(0, 32, (3, 8))
    expected = model(tokens)
    stages = []
    for names in default_stages(model, 2):
        stage = copy.deepcopy(model)
        keep_stage(stage, names)
        stages.append(stage)
    held = [[name for name, _ in stage.named_parameters()] for stage in stages]
    assert held[0] + held[1] == whole  # every parameter on one stage, under its own name
    assert held[0][0] == "tok_embeddings.weight" and held[1][0].startswith("layers.2.")
    assert stages[0].norm is None and stages[1].tok_embeddings is None
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](tokens)), expected)


def test_a_model_without_blocks_or_a_bad_split_is_refused_naming_what_to_do():
    """Fault: a split that loses or repeats parts reaching training (mutant: ``check_stages`` returning at once)."""
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no nn.ModuleDict or nn.ModuleList of blocks.*pipeline_stages\(num_stages\)"):
        default_stages(flat, 2)
    with pytest.raises(ValueError, match=r"holds 2 block\(s\), too few for 3 pipeline stages: use pipeline_parallel_size <= 2"):
        default_stages(StagedLlama(2), 3)
    with pytest.raises(ValueError, match=r"allowed: an integer >= 1"):
        default_stages(StagedLlama(2), 0)
    model = StagedLlama(2)
    assert top_level_names(model) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    with pytest.raises(ValueError, match=r"on no stage: \['norm'\]"):
        check_stages(model, [["tok_embeddings", "layers.0"], ["layers.1", "output"]], 2)
    with pytest.raises(ValueError, match=r"on several stages: \['layers.1'\]"):
        check_stages(model, [["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "norm", "output"]], 2)
    with pytest.raises(ValueError, match=r"unknown: \['head'\]"):
        check_stages(model, [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output", "head"]], 2)
    with pytest.raises(ValueError, match=r"returned 1 stage\(s\); allowed: exactly 2"):
        check_stages(model, [top_level_names(model)], 2)
