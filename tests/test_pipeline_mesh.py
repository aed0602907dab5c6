"""Pipeline parallelism composed with the other mesh dimensions, on 4 real gloo ranks (``pp`` outermost:
ranks 0-1 run stage 0, ranks 2-3 stage 1): pp 2 x dp_shard 2 (fsdp), pp 2 x dp_replicate 2 (HSDP) and
pp 2 x tp 2 (model-parallel) each end within 1e-5 of ``sp`` in every weight and every logged loss, with
clipping that bites.

Faults caught: the data-parallel rank or size counting the pipeline (the two stages' ranks would read
different shares: the stages would train on different samples); FSDP sharding a stage over the pp
peers instead of its own data-parallel ranks; the loss or metrics reduced over the wrong group (a sum
over pp peers counts each share twice).
"""

import os
from typing import Any, Dict

import pytest
from test_pipeline_training import MAX_NORM, close, train

from distributed import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WHOLE_VAL = dict(max_steps=2, max_val_steps_per_epoch=None)
"""Every validation sample: 2 data-parallel ranks evaluate the same samples as one process."""
LAYOUTS = {
    "pp2-dp2": dict(backend="fsdp"),
    "pp2-hsdp2": dict(backend="fsdp", data_parallel_replicate_size=2),
    "pp2-tp2": dict(backend="model-parallel", tensor_parallel_size=2),
}


def layouts(rank: int, out: str) -> Dict[str, Any]:
    return {
        name: train(os.path.join(out, name), pipeline_parallel_size=2, **WHOLE_VAL, **extra) for name, extra in LAYOUTS.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-mesh")
    reference = train(str(root / "sp"), **WHOLE_VAL)
    return reference, run_ranks(layouts, world_size=4, timeout=500, out=str(root))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_composes_with_data_and_tensor_parallelism(runs, layout):
    reference, ranks = runs
    assert max(reference["grad_norm"]) > MAX_NORM
    for rank, result in enumerate(ranks):
        stage = rank // 2
        assert ("tok_embeddings.weight" in result[layout]["weights"]) == (stage == 0), rank
        assert close(result[layout]["weights"], reference["weights"]) < 1e-5, rank
        for name in ("train_loss", "val_loss", "grad_norm"):
            found, expected = result[layout][name], reference[name]
            assert len(found) == len(expected) > 0 and max(abs(a - b) for a, b in zip(found, expected)) < 1e-5, (rank, name)
