"""The docs and CI promises stay true."""

import dataclasses
import os

from framework import TrainerArguments
from framework.checkpoint import DefaultCheckpointerArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path)) as handle:
        return handle.read()


def test_arguments_reference_lists_every_field():
    reference = read("docs/arguments.md")
    for cls in (TrainerArguments, DefaultCheckpointerArguments):
        missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in reference]
        assert not missing, f"docs/arguments.md lacks {cls.__name__} fields {missing}"


def test_ci_runs_the_readme_test_command():
    readme, ci = read("README.md"), read(".ci/run")
    command = 'pip install -e ".[dev]" && python -m pytest'
    assert command in readme and command in ci
    assert 'pip install -e ".[examples]" && python examples/run.py' in readme


def test_ci_lints_and_type_checks_before_the_tests():
    ci = read(".ci/run")
    tests_at = ci.index('pip install -e ".[dev]" && python -m pytest')
    for command in ("ruff check .", "ruff format --check .", "mypy framework backends"):
        assert -1 < ci.find(command) < tests_at, command
    hooks = read(".pre-commit-config.yaml")
    assert "repo: local" in hooks and "language: system" in hooks  # CI has no network for hook repositories


def test_one_version_and_the_license_setup_cfg_names():
    import framework

    setup_cfg = read("setup.cfg")
    assert "version = attr: framework.__version__" in setup_cfg
    assert framework.__version__.count(".") == 2
    assert "license = MIT" in setup_cfg and read("LICENSE").startswith("MIT License")
    assert "## [Unreleased]" in read("CHANGELOG.md")
