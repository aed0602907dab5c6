"""The conformance matrix (``framework/conformance/``): its design covers every pair, the built-in
backends pass every cell of it (known seams still fail, until their fix lands), and a plugin
with a typical fault fails it, naming the cell.

Cells are chosen by ``framework.conformance.report.suite_design``: a greedy pairwise covering
design (seed 0) over (feature, model, backend). One reference cache serves the whole module; each
multi-process backend runs all its cells in one 2-rank process group.
"""

import importlib
import os
import subprocess
import sys
from typing import ClassVar, Dict, Optional

import pytest

from backends import SingleProcess, TrainerBackend, available_backends, build_backend, register_backend
from backends.registry import unregister_backend
from framework.conformance import FEATURES, KNOWN_SEAMS, MODELS, conformance, format_table, register_feature
from framework.conformance.matrix import covering, runs_at, targeted_cells
from framework.conformance.registry import TARGETED
from framework.conformance.report import built_in_backends, run_backend, suite_design

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPOSITORY, "tests")


@pytest.fixture(scope="module", autouse=True)
def plugins_registered_here_are_gone_after():
    """The faulty plugins and the docs' plugin register in this process: leave the registry as found."""
    before = set(available_backends())
    yield
    for name in set(available_backends()) - before:
        unregister_backend(name)


@pytest.fixture(scope="module")
def reference_cache():
    """Reference (sp, sp-amp, sp-bf16) observations by cell, shared by every test here."""
    return {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("conformance"))


def _pairs(design):
    return (
        {(feature, model) for cells in design.values() for feature, model in cells},
        {(feature, backend) for backend, cells in design.items() for feature, _ in cells},
        {(model, backend) for backend, cells in design.items() for _, model in cells},
    )


def test_the_suite_design_covers_every_pair_and_joins_new_features_and_backends():
    backends = built_in_backends()
    assert {"sp", "ddp", "fsdp", "sp-amp", "fsdp-bf16"} <= set(backends)
    design = suite_design()
    assert design == suite_design()  # fixed seed: the same cells every run
    feature_model, feature_backend, model_backend = _pairs(design)
    covered = [model for model in MODELS if not TARGETED[model]]
    every = {
        (feature, model) for feature, spec in FEATURES.items() for model in covered if spec.models is None or model in spec.models
    }
    targeted = {(backend, cell) for backend in backends for cell in targeted_cells(backend)}
    assert {("model-parallel", ("automatic", "tied-tp")), ("fsdp", ("resume_kill9", "batchnorm"))} <= targeted
    assert all(cell in design[backend] for backend, cell in targeted)  # each shape where it matters
    assert feature_model == every | {cell for _, cell in targeted}  # a targeted shape nowhere else
    everywhere = [feature for feature, spec in FEATURES.items() if spec.every_backend]
    multi = [backend for backend in backends if build_backend(backend).multi_process]

    def runs_there(feature, backend):  # a single-process backend gets only what runs on 1 rank (evaluate_buffers: 2)
        models = [model for model in covered if FEATURES[feature].models is None or model in FEATURES[feature].models]
        return backend in multi or any(runs_at(feature, model, 1) for model in models)

    expected = {(feature, backend) for feature in everywhere for backend in backends if runs_there(feature, backend)}
    assert feature_backend >= expected
    assert "compile" not in everywhere  # seconds of inductor work per process: paired with its shapes only
    assert model_backend == {(model, backend) for model in covered for backend in backends} | {
        (model, backend) for backend, (_, model) in targeted
    }
    at_two = {(feature, backend) for backend in multi for feature, model in design[backend] if runs_at(feature, model, 2)}
    assert at_two >= {(feature, backend) for feature in everywhere for backend in multi}  # each at 2 ranks somewhere

    @register_feature("joins-by-registering", models=("mlp",))
    def joins(context, model):
        return {"state": [0.0]}

    register_backend("sp-joins", lambda args: TrainerBackend(SingleProcess.from_arguments(args)))
    try:
        grown = covering([*backends, "sp-joins"])
        assert ("joins-by-registering", "mlp") in grown["sp-joins"] or any(
            ("joins-by-registering", "mlp") in cells for cells in grown.values()
        )
        assert grown["sp-joins"]  # the new backend gets cells of its own
    finally:
        del FEATURES["joins-by-registering"]
        unregister_backend("sp-joins")


def _marked(name):
    """A backend as a test parameter: marked distributed when it runs on several ranks."""
    return pytest.param(name, marks=[pytest.mark.distributed] if build_backend(name).multi_process else [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", [_marked(name) for name in built_in_backends()])  # a new built-in joins here
def test_built_in_backends_pass_their_cells_of_the_matrix(backend, reference_cache, workdir):
    cells = suite_design()[backend]
    rows = run_backend(backend, cells, workdir, reference_cache)
    table = format_table(backend, rows)
    assert {row.check for row in rows} == {f"{feature}/{model}" for feature, model in cells}, table
    assert all(row.ok for row in rows), table
    fixed = [row.check for row in rows if row.result == "FIXED"]
    assert not fixed, f"known seams that pass now (remove them from KNOWN_SEAMS): {fixed}\n{table}"


def test_a_plugin_module_named_like_the_package_is_third_party(tmp_path, monkeypatch):
    """Only ``backends`` and ``backends.*`` are built-in: a plugin in a module ``backends_x`` is not."""
    (tmp_path / "backends_x.py").write_text(
        "from backends import SingleProcess, TrainerBackend, register_backend\n\n\n"
        "@register_backend('sp-from-backends-x')\n"
        "def sp_from_backends_x(args):\n"
        "    return TrainerBackend(SingleProcess.from_arguments(args))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "backends_x", raising=False)
    try:
        module = importlib.import_module("backends_x")
        assert module.sp_from_backends_x.__module__ == "backends_x"
        assert "sp-from-backends-x" in available_backends()
        assert "sp-from-backends-x" not in built_in_backends()
        assert "sp" in built_in_backends()  # the package's own still count
    finally:
        unregister_backend("sp-from-backends-x")
        sys.modules.pop("backends_x", None)


def test_every_known_seam_names_its_issue():
    for feature, model, backend, reason in KNOWN_SEAMS:
        assert "issue" in reason, (feature, model, backend, reason)


FAULTS = [
    ("ddp-no-allreduce", ("automatic", "mlp"), 2),  # gradients never averaged
    ("ddp-no-broadcast", ("automatic", "mlp"), 2),  # ranks start from their own weights
    ("ddp-dropping-no-sync", ("accumulation", "mlp"), 2),  # accumulated gradients thrown away
    ("sp-scaled-amp-no-unscale", ("clipping", "mlp"), 1),  # clipping the scaled gradients
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,cell,ranks", [pytest.param(*fault, marks=[pytest.mark.distributed] if fault[2] > 1 else []) for fault in FAULTS]
)
def test_a_faulty_plugin_fails_the_matrix_naming_the_cell(backend, cell, ranks, reference_cache, workdir):
    import conformance_faults  # noqa: F401  (registers the faulty backends here and, by name, in the ranks)

    rows = conformance(
        backend,
        imports=["conformance_faults"],
        world_sizes=(ranks,),
        cells=[cell],
        workdir=os.path.join(workdir, backend),
        reference_cache=reference_cache,
    )
    table = format_table(backend, rows)
    assert [(row.check, row.result) for row in rows] == [(f"{cell[0]}/{cell[1]}", "FAIL")], table
    assert f"FAILED: {cell[0]}/{cell[1]} ({ranks} rank" in table


def test_the_same_precision_that_unscales_before_clipping_passes(reference_cache, workdir):
    import conformance_faults  # noqa: F401

    rows = conformance(
        "sp-scaled-amp",
        world_sizes=(1,),
        cells=[("clipping", "mlp")],
        workdir=os.path.join(workdir, "scaled"),
        reference_cache=reference_cache,
    )
    assert [row.result for row in rows] == ["PASS"], format_table("sp-scaled-amp", rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_command_prints_the_table_and_exits_1_naming_the_failing_cell(tmp_path):
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([REPOSITORY, TESTS, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework.conformance",
            "ddp-no-allreduce",
            "--import",
            "conformance_faults",
            "--ranks",
            "2",
            "--features",
            "automatic,streams",
            "--models",
            "mlp",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=environment,
        cwd=REPOSITORY,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if "/" in line.split(" ")[0]}
    assert "FAIL" in rows["automatic/mlp"] and "PASS" in rows["streams/mlp"], result.stdout
    assert "FAILED: automatic/mlp (2 ranks)" in result.stdout


def _docs_plugin(directory) -> str:
    with open(os.path.join(REPOSITORY, "docs", "backends.md"), encoding="utf-8") as handle:
        text = handle.read()
    block = text.split("<!-- tested: tests/test_plugins.py -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    path = os.path.join(str(directory), "gradnorm_plugin.py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(block)
    return path


@pytest.mark.slow
@pytest.mark.distributed
def test_the_docs_plugin_example_passes_the_quick_cells_it_shares_with_ddp(tmp_path, reference_cache):
    cells = [("automatic", "per_rank_init"), ("clipping", "buffers"), ("manual", "mlp")]
    rows = conformance(
        "ddp-gradnorm",
        imports=[_docs_plugin(tmp_path)],
        world_sizes=(2,),
        cells=cells,
        workdir=str(tmp_path),
        reference_cache=reference_cache,
    )
    assert [row.result for row in rows] == ["PASS"] * 3, format_table("ddp-gradnorm", rows)


class _RefusesManual(TrainerBackend):
    unsupported_features: ClassVar[Dict[str, str]] = {"manual": "manual optimization is not supported"}

    def wrap_module(self, module):
        if not getattr(module, "module", module).automatic_optimization:
            raise ValueError("backend 'sp-no-manual' does not support manual optimization; use backend 'sp'")
        return super().wrap_module(module)


class _DeclaresButRuns(TrainerBackend):
    unsupported_features: ClassVar[Dict[str, str]] = {"manual": "manual optimization is not supported"}


def test_a_declared_refusal_must_come_before_step_1(tmp_path, reference_cache):
    register_backend("sp-no-manual", _RefusesManual)
    register_backend("sp-says-no-manual", _DeclaresButRuns)
    try:
        refused = conformance(
            "sp-no-manual", cells=[("manual", "mlp")], workdir=str(tmp_path / "a"), reference_cache=reference_cache
        )
        ran = conformance(
            "sp-says-no-manual", cells=[("manual", "mlp")], workdir=str(tmp_path / "b"), reference_cache=reference_cache
        )
    finally:
        unregister_backend("sp-no-manual")
        unregister_backend("sp-says-no-manual")
    assert [(row.check, row.result) for row in refused] == [("manual/mlp", "REFUSED")]
    assert "does not support manual optimization; use backend 'sp'" in refused[0].figure
    assert [row.result for row in ran] == ["FAIL"] and "without refusing" in ran[0].figure


def test_ranks_the_kit_cannot_run_as_asked_are_refused_naming_the_size(capsys):
    from framework.conformance.__main__ import main

    assert main(["ddp", "--ranks", "3", "--features", "automatic", "--models", "mlp"]) == 2
    assert "--ranks 3: none of the 1 selected cell(s) runs at 3 ranks" in capsys.readouterr().err
    assert main(["sp", "--ranks", "2", "--features", "automatic", "--models", "mlp"]) == 2
    assert "backend 'sp' is single-process; allowed: 1" in capsys.readouterr().err
    assert main(["sp", "--ranks", "0", "--features", "automatic", "--models", "mlp"]) == 2
    assert "world sizes must be integers >= 1" in capsys.readouterr().err


def test_an_exact_check_names_the_first_entry_that_differs_past_any_prefix():
    from framework.conformance.compare import _exact

    want = list(range(100))
    got = [*want[:77], -1, *want[78:]]
    passed, figure = _exact([{"seen": want}, {"seen": got}], {"seen": want}, "seen")
    assert not passed and figure == "seen on rank 1 differs at [77]: -1 (ref: 77)"


_OUTSIDE_MUTANT = """
from backends import FullPrecision
from framework.conformance.mutants.collectives import NoAllReduce
from framework.conformance.mutants.library import backend, register_mutant

register_mutant(
    "mutant-outside-ddp-no-allreduce", backend(NoAllReduce, FullPrecision), "never averages gradients",
    (("automatic", "mlp", 2),), "collectives", control="ddp",
)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_an_outside_mutant_is_built_on_the_spawned_ranks_and_a_harness_error_is_no_kill(tmp_path):
    from framework.conformance.mutants import MUTANTS
    from framework.conformance.mutation import format_mutants, run_mutants

    package = tmp_path / "outside_mutants"
    package.mkdir()
    (package / "__init__.py").write_text(_OUTSIDE_MUTANT, encoding="utf-8")
    from framework.conformance.ranks import import_plugin

    import_plugin(str(package))  # a package directory, as --import takes it
    try:
        name = "mutant-outside-ddp-no-allreduce"
        missing, _ = run_mutants([name], workdir=str(tmp_path / "a"), controls=False)  # the ranks never import it
        imported, _ = run_mutants([name], workdir=str(tmp_path / "b"), controls=False, imports=[str(package)])
    finally:
        MUTANTS.pop("mutant-outside-ddp-no-allreduce", None)
    report = format_mutants(missing, [])
    assert not missing[0].killed and missing[0].errors, report
    assert "1 could not be run (harness errors: no verdict)" in report and "cannot be built on this rank" in report
    assert imported[0].killed and not imported[0].errors, format_mutants(imported, [])
    assert imported[0].killer.check == "automatic/mlp"


class _BF16AgainstFP32(TrainerBackend):
    """A correct new precision (true bf16) that names fp32 ``sp`` as its reference and declares its dtype."""

    conformance_reference: ClassVar[Optional[str]] = "sp"
    conformance_compute_dtype: ClassVar[Optional[str]] = "bfloat16"


class _NamesNoReference(TrainerBackend):
    conformance_reference: ClassVar[Optional[str]] = "sp-nowhere"


def test_a_backend_declares_its_reference_and_is_judged_in_its_own_dtype(tmp_path, reference_cache):
    from backends import TrueBF16

    register_backend("sp-bf16-vs-sp", lambda args: _BF16AgainstFP32(SingleProcess.from_arguments(args), TrueBF16()))
    register_backend("sp-no-reference", lambda args: _NamesNoReference(SingleProcess.from_arguments(args)))
    try:
        rows = conformance("sp-bf16-vs-sp", cells=[("automatic", "mlp")], workdir=str(tmp_path), reference_cache=reference_cache)
        with pytest.raises(ValueError, match=r"conformance_reference='sp-nowhere', which is not registered"):
            conformance("sp-no-reference", cells=[("automatic", "mlp")], workdir=str(tmp_path / "b"))
    finally:
        unregister_backend("sp-bf16-vs-sp")
        unregister_backend("sp-no-reference")
    table = format_table("sp-bf16-vs-sp", rows)
    assert [(row.result, row.tolerance) for row in rows] == [("PASS", "0.05")], table
    assert "max |state - ref|" in rows[0].figure and rows[0].figure != "max |state - ref| = 0", table


def test_a_grad_scaler_precision_is_compared_with_the_scaled_reference(tmp_path, reference_cache):
    from framework.conformance.runner import reference_backend

    assert reference_backend("sp-scaled-amp") == "sp-scaled-amp" and reference_backend("sp-amp") == "sp-amp"
    rows = conformance(
        "sp-scaled-amp", cells=[("nan_stop", "mlp"), ("overflow", "mlp")], workdir=str(tmp_path), reference_cache=reference_cache
    )
    assert [row.result for row in rows] == ["PASS", "PASS"], format_table("sp-scaled-amp", rows)


def test_a_plugins_declared_shapes_are_read_after_its_import(tmp_path, capsys):
    """``--import plugin.py`` registers the backend before the command line picks the cells: a
    plugin that declares ``conformance_shapes`` (as docs/pipeline-parallel.md tells a pipeline
    plugin to) runs those shapes only (they were read before the import: every shape ran, and a
    correct pipeline plugin failed 27 of 35 quick cells)."""
    from framework.conformance.__main__ import main

    plugin = tmp_path / "one_shape_plugin.py"
    plugin.write_text(
        "from backends import FullPrecision, SingleProcess, TrainerBackend, register_backend\n\n\n"
        "class OneShape(TrainerBackend):\n"
        "    conformance_shapes = ('tied',)\n\n\n"
        "register_backend('sp-one-shape', lambda args: OneShape(SingleProcess.from_arguments(args), FullPrecision()))\n"
    )  # no override=True: the kit imports the file once
    try:
        assert main(["sp-one-shape", "--import", str(plugin), "--features", "automatic", "--workdir", str(tmp_path / "w")]) == 0
    finally:
        unregister_backend("sp-one-shape")
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("automatic/")]
    assert rows == ["automatic/tied"], rows


def test_a_plugin_that_cannot_be_imported_is_refused_naming_it(tmp_path, capsys):
    """``--import`` runs before the cells are picked: a directory that is no package still exits 2
    with a message naming it and what is allowed, not a traceback."""
    from framework.conformance.__main__ import main

    (tmp_path / "not_a_package").mkdir()
    assert main(["sp", "--import", str(tmp_path / "not_a_package"), "--features", "automatic"]) == 2
    error = capsys.readouterr().err
    assert "not_a_package: a directory must be a package (hold __init__.py)" in error, error
