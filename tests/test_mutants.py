"""The mutant library (``framework/conformance/mutants/``) and the kit's mutation score: every
mutant is killed by a cell it declares, naming the cell and the figure; each mutant's correct
control passes the same cells; a rank that dies in a cell fails that cell only."""

import importlib
import os
import sys

import pytest

from backends import available_backends
from backends.registry import unregister_backend
from framework.conformance import conformance, format_table
from framework.conformance.mutants import MUTANTS, register_mutant
from framework.conformance.mutation import control_of, format_mutants, run_mutants


@pytest.fixture(scope="module", autouse=True)
def registry_left_as_found():
    before, imported = set(available_backends()), "conformance_faults" in sys.modules
    yield
    for name in set(available_backends()) - before:
        unregister_backend(name)
    if not imported:  # a later `import conformance_faults` must register its backends again (test_conformance.py)
        sys.modules.pop("conformance_faults", None)


def test_the_library_covers_every_kind_of_promise_and_names_each_fault():
    assert len(MUTANTS) >= 16
    kinds = {mutant.kind for mutant in MUTANTS.values()}
    assert kinds >= {"collectives", "broadcasts", "data", "precision", "clipping", "state", "evaluation"}
    for name, mutant in MUTANTS.items():
        assert name.startswith("mutant-") and mutant.fault and "\n" not in mutant.fault, name
        assert control_of(name) in available_backends(), name
    with pytest.raises(ValueError, match=r"kills=.*allowed"):
        register_mutant("mutant-bad", lambda args: None, "no cells", (), "data")
    with pytest.raises(ValueError, match=r"kills=.*allowed"):
        register_mutant("mutant-bad", lambda args: None, "three ranks", (("automatic", "mlp", 3),), "data")


@pytest.mark.slow
@pytest.mark.distributed
def test_the_mutation_score_is_100_percent_and_every_control_passes(tmp_path):
    mutants, controls = run_mutants(workdir=str(tmp_path))
    report = format_mutants(mutants, controls)
    assert report.startswith(f"mutation score: {len(MUTANTS)} of {len(MUTANTS)} killed (100%)"), report
    for verdict in mutants:
        killer = verdict.killer
        declared = {(f"{feature}/{model}", ranks) for feature, model, ranks in MUTANTS[verdict.backend].kills}
        assert killer is not None and (killer.check, killer.ranks) in declared, report
        assert f"killed    {verdict.backend} by {killer.check}" in report
    assert all(row.result == "PASS" for verdict in controls for row in verdict.rows), report
    assert {verdict.backend for verdict in controls} >= {"ddp", "fsdp", "model-parallel", "sp-scaled-amp", "fsdp-amp"}
    assert "tolerance 0.05: correct controls at most" in report, report


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_dies_in_a_cell_fails_that_cell_and_the_next_cell_runs(tmp_path):
    import conformance_faults

    importlib.reload(conformance_faults)  # registers again where test_conformance.py imported it and unregistered after

    rows = conformance(
        "ddp-aborts-on-buffers",
        imports=["conformance_faults"],
        world_sizes=(2,),
        cells=[("automatic", "buffers"), ("automatic", "mlp")],
        workdir=os.path.join(str(tmp_path), "aborts"),
    )
    table = format_table("ddp-aborts-on-buffers", rows)
    assert [(row.check, row.result) for row in rows] == [("automatic/buffers", "FAIL"), ("automatic/mlp", "PASS")], table
    assert rows[0].figure.startswith("rank 1: rank 1 died of SIGABRT in this cell"), table
