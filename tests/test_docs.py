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


def test_the_numbers_the_docs_quote_are_the_ones_the_example_logs(monkeypatch):
    from framework.checkpoint.plan import describe_checkpointing
    from framework.config.cli import parse_config

    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from digits import DigitsArguments

    config = parse_config({"model": DigitsArguments}, argv=["--config", os.path.join(ROOT, "examples", "digits.yaml")])
    logged = describe_checkpointing(config.checkpointer, os.path.join(config.trainer.output_dir, "checkpoints"))
    assert logged in " ".join(read("docs/getting-started.md").split())  # the page quotes the line the example logs


def test_the_cpu_install_is_the_first_thing_a_linux_user_reads_and_every_backend_is_in_the_table():
    from backends import available_backends

    readme = read("README.md")
    cpu_install = readme.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert cpu_install < readme.index("pip install -e")  # before the first install command
    table = readme[readme.index("## Backends") :]
    table = table[: table.index("\n\n", table.index("| name |"))]
    from backends.registry import _registry

    built_ins = [name for name in available_backends() if _registry[name].__module__.startswith("backends.")]  # not plugins
    assert "sp" in built_ins and "fsdp" in built_ins
    assert [name for name in built_ins if f"`{name}`" not in table] == []
