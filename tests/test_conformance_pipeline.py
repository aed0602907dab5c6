"""The kit's pipeline rows (``framework/conformance/pipeline_rows.py``): ``fsdp-pp`` runs ``fsdp`` with 2
pipeline stages (pp 2 at 2 ranks, pp 2 x dp 2 at 4) on the ``pipeline`` shape, compared with ``sp`` on the
same module; what a schedule cannot run is refused before step 1. The pipeline mutants
(``framework/conformance/mutants/pipeline.py``) are run, with every other mutant, by tests/test_mutants.py."""

import pytest

from backends import build_backend
from framework.conformance import conformance, format_table
from framework.conformance.layouts import describe_layout, layout_options
from framework.conformance.matrix import targeted_cells
from framework.conformance.mutants import MUTANTS
from framework.conformance.mutants.pipeline import MUTANTS as PIPELINE_MUTANTS
from framework.conformance.mutation import cells_of, control_of
from framework.conformance.pipeline_rows import CELLS, REFUSED
from framework.conformance.runner import shapes_of


def test_a_pipeline_row_is_fsdp_with_two_stages_on_its_own_shape():
    """Faults: a row without its layout (it would run plain fsdp and prove nothing about a pipeline), a
    table that names the wrong mesh, a row run on shapes that define no pipeline_inputs (every cell a
    spurious failure), and a row that does not declare what a schedule refuses."""
    assert layout_options("fsdp-pp", 2) == {"pipeline_parallel_size": 2} == layout_options("fsdp-pp", 4)
    assert layout_options("fsdp-pp", 1) == {}  # one rank: no pipeline, fsdp itself
    assert (describe_layout("fsdp-pp", 2), describe_layout("fsdp-pp", 4)) == ("pp 2", "pp 2 x dp 2")
    row = build_backend("fsdp-pp")
    assert type(row.strategy) is type(build_backend("fsdp").strategy)
    assert sorted(row.declared_unsupported_features) == sorted(REFUSED) == ["auto_micro_batch", "manual"]
    assert targeted_cells("fsdp-pp") == [(feature, "pipeline") for feature in CELLS]
    assert targeted_cells("fsdp") == [cell for cell in targeted_cells("fsdp") if cell[1] != "pipeline"]
    assert shapes_of("fsdp-pp", [("automatic", "mlp"), ("clipping", "pipeline")]) == [("clipping", "pipeline")]


def test_each_pipeline_mutant_is_checked_against_the_row_and_killed_by_a_pipeline_cell():
    """Faults: a pipeline mutant compared with plain fsdp (the control would fail every pipeline cell),
    or a mutant whose kill is a cell of another shape (the fault would be killed by a refusal)."""
    assert len(PIPELINE_MUTANTS) == 5
    for name in PIPELINE_MUTANTS:
        assert control_of(name) == "fsdp-pp", name
        assert all(model == "pipeline" and ranks == 2 for _, model, ranks in MUTANTS[name].kills), name
        every = cells_of(MUTANTS[name], every=True)
        assert every and all(cell[1] == "pipeline" for cell, _ in every), (name, every)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_with_a_pipeline_passes_its_rows_cells(ranks, tmp_path):
    """Faults: pipeline stages that do not start from rank zero's weights (stage 1 kept its own rank's
    initialisation: every training cell 0.64 from sp), a loss scaled or logged wrongly, clipping by one
    stage's norm, a resume that is not bitwise, and a refusal that comes after step 1 or never."""
    rows = conformance("fsdp-pp", world_sizes=(ranks,), workdir=str(tmp_path), timeout=900.0)
    table = format_table("fsdp-pp", rows)
    assert [row.check for row in rows] == [f"{feature}/pipeline" for feature in CELLS], table
    assert all(row.ranks == ranks for row in rows), table
    refused = {f"{feature}/pipeline" for feature in REFUSED}
    assert all(row.result == ("REFUSED" if row.check in refused else "PASS") for row in rows), table
    assert f"({ranks} ranks: {describe_layout('fsdp-pp', ranks)})" in table.splitlines()[0], table
