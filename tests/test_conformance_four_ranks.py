"""The kit's 4-rank tier (``--ranks 4``): the built-in ``fsdp`` runs HSDP 2x2 and ``model-parallel``
a dp 2 x tp 2 mesh, each passing its cells against ``sp``; faults of those meshes that 2 ranks
cannot reach are killed there and only there; ``--ranks`` runs exactly the sizes it names."""

import pytest

from framework.conformance import conformance, format_table
from framework.conformance.layouts import describe_layout, layout_options

CELLS = {
    # HSDP 2x2: gradients reduce-scattered in each replica group and all-reduced across them, clipped
    # by the norm over every shard, and a resume from shards written by the 2x2 mesh
    "fsdp": [("automatic", "mlp"), ("clipping", "mlp"), ("resume_kill9", "mlp")],
    # dp 2 x tp 2: data split by rows, outputs gathered from each row's first rank, sum/max/min metrics
    # reduced over the rows only (tensor-parallel peers hold the same values)
    "model-parallel": [("automatic", "mlp"), ("evaluate", "mlp"), ("probes", "mlp")],
    # 4 plain ranks: a sum of 4 gradients depends on its bucket layout, so a resume is bitwise only when
    # the resumed first step reduces in the layout of every later step (backends/strategies/ddp_ready_order.py)
    "ddp": [("resume_kill9", "mlp")],
}


def test_at_4_ranks_fsdp_runs_hsdp_2x2_and_model_parallel_a_2x2_mesh():
    assert layout_options("fsdp", 4) == {"data_parallel_replicate_size": 2}
    assert layout_options("fsdp-amp", 4) == {"data_parallel_replicate_size": 2}
    assert layout_options("model-parallel", 4) == {"tensor_parallel_size": 2}
    assert layout_options("ddp", 4) == {} and layout_options("fsdp", 2) == {} and layout_options("model-parallel", 2) == {}
    assert (describe_layout("fsdp", 4), describe_layout("model-parallel", 4)) == ("HSDP 2x2", "dp 2 x tp 2")


def test_ranks_runs_exactly_the_sizes_named_or_refuses(capsys):
    from framework.conformance.__main__ import main
    from framework.conformance.matrix import sized_cells

    # batch norm computes per rank (compared at 1 rank only), compile runs at 1 and 2: neither at 4
    asked = [("automatic", "mlp"), ("automatic", "batchnorm"), ("compile", "mlp"), ("evaluate_buffers", "batchnorm")]
    assert sized_cells(asked, [4]) == [("automatic", "mlp"), ("evaluate_buffers", "batchnorm")]
    assert sized_cells(asked, [1]) == asked[:3]

    # world_size_change runs at 1 and 2 ranks only: asked for 4, it is refused, not run at another size
    assert main(["fsdp", "--ranks", "4", "--features", "world_size_change", "--models", "mlp"]) == 2
    assert "--ranks 4: none of the 1 selected cell(s) runs at 4 ranks" in capsys.readouterr().err
    assert main(["ddp", "--ranks", "3", "--features", "automatic", "--models", "mlp"]) == 2
    assert "--ranks 3: none of the 1 selected cell(s) runs at 3 ranks (the features run at 1, 2, 4 ranks)" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("backend", list(CELLS))
def test_the_built_in_backends_pass_their_4_rank_cells(backend, tmp_path):
    rows = conformance(backend, world_sizes=(4,), cells=CELLS[backend], workdir=str(tmp_path), timeout=900.0)
    table = format_table(backend, rows)
    assert [(row.check, row.ranks) for row in rows] == [(f"{feature}/{model}", 4) for feature, model in CELLS[backend]], table
    assert all(row.result == "PASS" for row in rows), table
    if describe_layout(backend, 4):  # a 2-D mesh names its layout; ddp runs 4 plain ranks
        assert f"(4 ranks: {describe_layout(backend, 4)})" in table.splitlines()[0], table


@pytest.mark.slow
@pytest.mark.distributed
def test_a_fault_of_a_2d_mesh_or_of_4_ranks_is_killed_at_4_ranks_only(tmp_path):
    """Faults: HSDP that reduces over the shard group only (replica groups drift apart), a
    model-parallel gather that takes the first ranks, not each row's first, as the rows' voices, and
    DDP as torch builds it (a resumed first step sums in another bucket layout: 1e-8 off)."""
    from framework.conformance.mutants import MUTANTS
    from framework.conformance.mutation import MUTANTS_MODULE, format_mutants, run_mutants

    names = ["mutant-fsdp-hsdp-shard-group-only", "mutant-model-parallel-first-ranks-represent", "mutant-ddp-first-step-layout"]
    mutants, _ = run_mutants(names, workdir=str(tmp_path / "four"), controls=False)
    report = format_mutants(mutants, [])
    assert [(verdict.killed, verdict.killer.ranks if verdict.killer else None) for verdict in mutants] == [(True, 4)] * 3, report
    for name in names:  # the same cells at 2 ranks: one replica group, one row, a + b; the fault cannot show
        cells = [(feature, model) for feature, model, _ in MUTANTS[name].kills]
        rows = conformance(
            name, imports=[MUTANTS_MODULE], world_sizes=(2,), cells=cells, workdir=str(tmp_path / name), timeout=900.0
        )
        assert [row.result for row in rows] == ["PASS"], format_table(name, rows)
