"""The public API is a snapshot: a change to what ``framework``, ``framework.callbacks``,
``framework.checkpoint``, ``framework.loggers`` or ``backends`` export (names, signatures, public
methods) is a deliberate, reviewed diff of ``tests/public_api.txt`` with a CHANGELOG line.

Regenerate the snapshot after a deliberate change (and review ``git diff tests/public_api.txt``)::

    python tests/test_public_api.py --regenerate

Module paths that earlier docs showed still import, warning with the new path.
"""

import importlib
import inspect
import os
import subprocess
import sys
import warnings
from typing import Any, List

if __name__ == "__main__":  # run as a script: this checkout's packages, not an installed copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

from framework.deprecated_paths import MOVED_MODULES

PUBLIC_MODULES = ("framework", "framework.callbacks", "framework.checkpoint", "framework.loggers", "backends")
SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "public_api.txt")
ROOT = os.path.dirname(os.path.dirname(SNAPSHOT))
REGENERATE = "python tests/test_public_api.py --regenerate"


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def describe(qualified: str, obj: Any) -> List[str]:
    """Snapshot lines of one exported name: a function's or class's signature, a class's public
    methods and properties (those it defines or inherits from the framework), a constant's type."""
    if inspect.isclass(obj):
        lines = [f"class {qualified}{_signature(obj)}"]
        for name in sorted(dir(obj)):
            if name.startswith("_"):
                continue
            owner = next((klass for klass in obj.__mro__ if name in vars(klass)), None)
            if owner is None or not owner.__module__.startswith(("framework", "backends")):
                continue  # torch.nn.Module's, Enum's, ... methods are not this project's API
            member = vars(owner)[name]
            if isinstance(member, property):
                lines.append(f"    {name}: property")
            elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
                lines.append(f"    {name}{_signature(getattr(obj, name))}")
            elif not inspect.isclass(member):
                lines.append(f"    {name}: {type(member).__name__}")
        return lines
    if callable(obj):
        return [f"def {qualified}{_signature(obj)}"]
    return [f"{qualified}: {type(obj).__name__}"]


def _old_config_names() -> List[str]:
    """The names of the old module ``framework.config``, now a package that forwards them to ``cli``."""
    import framework.config

    return sorted(framework.config._OLD_MODULE_NAMES)


def snapshot() -> str:
    lines: List[str] = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(module.__all__):
            lines.extend(describe(f"{module_name}.{name}", getattr(module, name)))
    lines.append("")
    lines.extend(f"moved module {old} -> {new}" for old, new in sorted(MOVED_MODULES.items()))
    lines.extend(f"moved name framework.config.{name} -> framework.config.cli.{name}" for name in _old_config_names())
    return "\n".join(lines) + "\n"


def test_public_api_matches_the_snapshot():
    with open(SNAPSHOT) as handle:
        expected = handle.read()
    actual = snapshot()
    if actual != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "public_api.txt", "now"))
        pytest.fail(f"the public API changed; if deliberate, run `{REGENERATE}` and add a CHANGELOG line:\n{diff}")


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_path_still_imports_and_warns_with_the_new_path(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])  # the same module: one object, one state
    assert module.__spec__.name == MOVED_MODULES[old]
    assert [str(w.message) for w in caught if w.category is FutureWarning] == [
        f"{old} is deprecated: import {MOVED_MODULES[old]} instead"
    ]


@pytest.mark.parametrize("name", _old_config_names())
def test_a_name_of_the_old_config_module_still_imports_from_the_package_and_warns(name):
    """framework.config was the command-line module; a package now, it forwards that module's names."""
    import framework.config.cli

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module("framework.config"), name)
    assert value is getattr(framework.config.cli, name)
    assert [str(w.message) for w in caught if w.category is FutureWarning] == [
        f"framework.config.{name} is deprecated: import framework.config.cli.{name} instead"
    ]


def test_the_old_names_of_the_docs_import():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from framework.plot import plot_metrics  # noqa: F401
        from framework.prediction import load_predictions  # noqa: F401
        from framework.rng import seed_everything  # noqa: F401
        from framework.run_lock import STALE_AFTER_SECONDS, RunLocked  # noqa: F401

        from framework.config import parse_config  # noqa: F401


def test_python_dash_m_of_an_old_path_runs_the_new_module(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,name,value\n0,1,train_loss,1.0\n0,2,train_loss,0.5\n")
    environment = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, "-m", "framework.plot", str(tmp_path), "-o", str(tmp_path / "out.png")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.png").stat().st_size > 0
    assert "framework.plot is deprecated: import framework.metrics.plot instead" in result.stderr


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {REGENERATE}")
    with open(SNAPSHOT, "w") as handle:
        handle.write(snapshot())
    print(f"wrote {os.path.relpath(SNAPSHOT, ROOT)}: review it with `git diff tests/public_api.txt`")
