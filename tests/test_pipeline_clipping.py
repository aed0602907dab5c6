"""Gradient clipping over a pipeline: each stage holds only its own layers, and no placement says
that the rest of the model lives on the other ranks; the norm is all-reduced over the pipeline's
group (``SUM`` of ``norm ** 2``, ``MAX`` for the inf norm), on 2 real gloo ranks (each rank one
stage: plain tensors on stage 0, an FSDP-style DTensor on stage 1).
"""

import math
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from distributed import run_ranks

from backends.strategies.gradient_clipping import clip_gradients, total_grad_norm

GRADIENTS = {0: [torch.tensor([3.0, 0.0]), torch.tensor([0.0])], 1: [torch.tensor([4.0, -12.0])]}
"""Stage 0 holds two parameters, stage 1 one: the whole model's 2-norm is 13, its inf norm 12."""


def parameters_of(rank: int) -> list:
    found = []
    for gradient in GRADIENTS[rank]:
        parameter = torch.nn.Parameter(torch.zeros_like(gradient))
        parameter.grad = gradient.clone()
        found.append(parameter)
    return found


def clipping_scenarios(rank: int) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    results: Dict[str, Any] = {}
    plain = parameters_of(rank)
    results["norm"] = float(clip_gradients(plain, max_norm=6.5, pipeline_group=group))
    results["clipped"] = [parameter.grad.tolist() for parameter in plain]
    results["inf"] = float(total_grad_norm(parameters_of(rank), norm_type=math.inf, pipeline_group=group))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp_shard"))  # as a pipeline of 2 stages builds it
    group, mesh = mesh.get_group("pp"), mesh["dp_shard"]
    mixed = parameters_of(rank)
    if rank == 1:  # stage 1's parameter a DTensor (FSDP's), stage 0's plain
        parameter = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate()]))
        parameter.grad = distribute_tensor(GRADIENTS[1][0].clone(), mesh, [Replicate()])
        mixed = [parameter]
    results["mixed_norm"] = float(clip_gradients(mixed, max_norm=6.5, pipeline_group=group))
    results["without_group"] = float(total_grad_norm(parameters_of(rank)))
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(clipping_scenarios)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_stage_clips_by_the_whole_pipelines_norm(runs):
    """Fault: a stage clipped by its own norm (mutant: no all-reduce over ``pipeline_group``: rank 0
    measures 3, rank 1 12.65, and each scales by its own factor)."""
    for rank, result in enumerate(runs):
        assert result["norm"] == pytest.approx(13.0), rank
        assert result["mixed_norm"] == pytest.approx(13.0), rank
        expected = [[value * 0.5 for value in gradient.tolist()] for gradient in GRADIENTS[rank]]
        assert result["clipped"] == [pytest.approx(values) for values in expected], rank
    assert [result["without_group"] for result in runs] == pytest.approx([3.0, math.sqrt(160.0)])


@pytest.mark.distributed
@pytest.mark.slow
def test_the_inf_norm_is_the_maximum_over_the_stages(runs):
    """Fault: the inf norm summed over stages (mutant: ``SUM`` for every norm: 15 instead of 12)."""
    assert [result["inf"] for result in runs] == [12.0, 12.0]
