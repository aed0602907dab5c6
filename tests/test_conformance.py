"""The conformance kit (``python -m framework.conformance``) on every built-in backend, on the
plugin example of docs/backends.md, and on a broken plugin that it must catch.

Each run is one CLI process: the ``sp`` reference in-process, the backend on 1 rank in-process
and on 2 gloo ranks in one process group that runs every check in sequence.
"""

import os
import subprocess
import sys
import textwrap

import pytest

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BROKEN_PLUGIN = '''
from backends import DDP, FullPrecision, TrainerBackend, register_backend


class NoAllReduce(DDP):
    """Joins the process group but never wraps the module: gradients are never averaged."""

    def wrap_module(self, module):
        return module


register_backend("ddp-no-allreduce", lambda: TrainerBackend(NoAllReduce(), FullPrecision()))
'''


def kit(*arguments: str, timeout: float = 900) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=REPOSITORY + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "framework.conformance", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=REPOSITORY,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sp", "sp-amp"])
def test_kit_passes_on_single_process_backends(backend):
    result = kit(backend)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "15 of 15 passed" in result.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "backend",
    ["ddp", "ddp-amp", "fsdp", "fsdp-amp"],
)
def test_kit_passes_on_distributed_backends(backend):
    result = kit(backend)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "30 of 30 passed" in result.stdout


def _docs_plugin(directory) -> str:
    with open(os.path.join(REPOSITORY, "docs", "backends.md"), encoding="utf-8") as handle:
        text = handle.read()
    block = text.split("<!-- tested: tests/test_plugins.py -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    path = os.path.join(str(directory), "gradnorm_plugin.py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(textwrap.dedent(block))
    return path


@pytest.mark.slow
@pytest.mark.distributed
def test_kit_passes_on_the_docs_plugin_example(tmp_path):
    result = kit("ddp-gradnorm", "--import", _docs_plugin(tmp_path), "--ranks", "2")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "15 of 15 passed" in result.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_kit_fails_a_plugin_that_skips_the_gradient_all_reduce(tmp_path):
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text(BROKEN_PLUGIN)
    result = kit("ddp-no-allreduce", "--import", str(plugin), "--ranks", "2", "--checks", "automatic,manual")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    assert "FAIL" in rows["automatic optimization, derived accumulation, clipping"]
    assert "FAIL" in rows["manual optimization, two optimizers"]
    assert "FAILED: automatic optimization" in result.stdout


def test_a_declared_refusal_is_reported_and_not_run(tmp_path):
    from typing import ClassVar, Dict

    from backends.base import TrainerBackend
    from backends.registry import register_backend, unregister_backend
    from framework.conformance import conformance, format_table

    class NoManual(TrainerBackend):
        unsupported_features: ClassVar[Dict[str, str]] = {"manual": "refuses automatic_optimization = False before step 1"}

    register_backend("sp-no-manual", NoManual)
    try:
        rows = conformance("sp-no-manual", names=["manual"], workdir=str(tmp_path))
    finally:
        unregister_backend("sp-no-manual")
    assert [(row.check, row.result) for row in rows] == [("manual optimization, two optimizers", "DECLARED")]
    assert "1 of 1 passed" in format_table("sp-no-manual", rows)
