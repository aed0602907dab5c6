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
