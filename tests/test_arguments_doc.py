"""docs/arguments.md's field tables are generated from the field docstrings (what ``--help`` shows):
they cannot drift. Rewrite them with ``python tests/test_arguments_doc.py``.

Faults caught: a field added, renamed, retyped or re-documented in the code and not in the docs (the
tables differ); a field added without a docstring (``undocumented_fields``: the mutant below).
"""

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "arguments.md")


def test_the_field_tables_are_what_the_docstrings_say():
    from framework.config.help import generated_arguments_doc

    with open(DOC, encoding="utf-8") as handle:
        current = handle.read()
    assert current.count("<!-- fields: ") == 2
    assert generated_arguments_doc(current) == current, "run: python tests/test_arguments_doc.py"


def test_every_field_has_a_docstring_and_a_mutant_without_one_is_found():
    from framework import TrainerArguments
    from framework.checkpoint import DefaultCheckpointerArguments
    from framework.config.help import markdown_fields, undocumented_fields

    assert undocumented_fields(TrainerArguments) == [] and undocumented_fields(DefaultCheckpointerArguments) == []

    @dataclasses.dataclass
    class WithANewField(TrainerArguments):  # the mutant: a field added without its docstring
        warmup_steps: int = 0

    assert undocumented_fields(WithANewField) == ["warmup_steps"]
    assert "| `warmup_steps` |" in markdown_fields(WithANewField)  # and the table would change with it


if __name__ == "__main__":  # rewrite the tables from the code
    sys.path.insert(0, ROOT)
    from framework.config.help import generated_arguments_doc

    with open(DOC, encoding="utf-8") as handle:
        text = handle.read()
    with open(DOC, "w", encoding="utf-8") as handle:
        handle.write(generated_arguments_doc(text))
