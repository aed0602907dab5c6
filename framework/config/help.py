"""The ``--help`` text of :func:`framework.config.cli.parse_config`: every section and field with its
type, default and the docstring written under the field."""

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from framework.config.conversion import type_name

_HIDDEN_FIELDS = {("trainer", "checkpointer_args")}  # set from the checkpointer section


def _usage(program: str) -> str:
    return f"usage: {program} [--config FILE.yaml] [--SECTION.FIELD VALUE ...] [--backend NAME]  (--help lists every field)"


def field_docs(cls: Type) -> Dict[str, str]:
    """The string literal under each dataclass field (its attribute docstring), base classes included."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, body[1:]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        try:
            return repr(f.default_factory())
        except Exception:  # help must not fail on a factory
            return "(computed)"
    return "(required)"


def _plain_text(text: str) -> str:
    """Docstring markup (``code``, :class:`~x.Y`) as plain text for the terminal."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", text)
    text = re.sub(r"\[([^\]]+)\]\(([^)#]+)[^)]*\)", r"\1", text)  # a docs link: its page's name
    return text.replace("``", "")


def format_help(classes: Mapping[str, Type], program: str = "run.py", current: Optional[Any] = None) -> str:
    """The ``--help`` text: every section and field with type, default and description;
    with ``current`` (the other arguments, parsed), values that differ from the defaults."""
    lines = [
        _usage(program).split("  (")[0],
        "",
        "Values come from the field defaults, then --config, then the command line.",
        "A boolean field given without a value is set to true. --backend NAME is --trainer.backend NAME.",
        "--print_config prints the resolved config as YAML (loadable with --config) and exits: add it to any",
        "command line to see every value the run would use.",
    ]
    for section, cls in classes.items():
        summary = (inspect.getdoc(cls) or "").strip().splitlines()
        lines += ["", f"{section}:" + (f"  {_plain_text(summary[0])}" if summary else "")]
        values = current.to_dict().get(section, {}) if current is not None else {}
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in _HIDDEN_FIELDS or not f.init:
                continue
            default = _default_text(f)
            now = repr(values[f.name]) if f.name in values else default
            this_run = f"; this run: {now}" if now != default else ""
            lines.append(f"  --{section}.{f.name} ({type_name(hints.get(f.name, f.type))}, default {default}{this_run})")
            if f.name in docs:
                lines.append(f"      {_plain_text(docs[f.name])}")
        if section == "trainer":
            lines += backend_option_help(values.get("backend_options", {}))
    return "\n".join(lines)


def backend_option_help(current: Mapping[str, Any]) -> List[str]:
    """The options registered backends declare, grouped under the backends that declare them (one
    group for backends with the same declarations), as ``--help`` lists them; ``current``: this run's values."""
    from backends import available_backends
    from backends.registry import declared_options

    groups: Dict[Tuple[Any, ...], List[str]] = {}
    declarations = {}
    for name in available_backends():
        declared = declared_options(name)
        if declared:
            key = tuple((option, repr(d.default), d.help, d.type_name, d.choices) for option, d in declared.items())
            groups.setdefault(key, []).append(name)
            declarations[key] = declared
    if not groups:
        return []
    lines = ["", "trainer.backend_options:  each backend's own options (a name the chosen backend does not declare is refused)"]
    for key, names in groups.items():
        lines.append(f"  {', '.join(names)}:")
        for option, declaration in declarations[key].items():
            now = f"; this run: {current[option]!r}" if option in current and current[option] != declaration.default else ""
            choices = f", one of {list(declaration.choices)!r}" if declaration.choices is not None else ""
            kind = f"{declaration.type_name}{choices}, default {declaration.default!r}{now}"
            lines.append(f"    --trainer.backend_options.{option} ({kind})")
            if declaration.help:
                lines.append(f"        {declaration.help}")
    return lines


ARGUMENTS_DOC = "docs/arguments.md"
"""The arguments reference; its field tables are :func:`markdown_fields`' output, between markers."""


def markdown_fields(cls: Type) -> str:
    """The markdown table of ``cls``'s fields (type, default, the docstring under each field):
    what ``docs/arguments.md`` holds between ``<!-- fields: NAME -->`` and ``<!-- /fields -->``.

    Example:
        >>> from framework.checkpoint import DefaultCheckpointerArguments
        >>> markdown_fields(DefaultCheckpointerArguments).splitlines()[2].startswith("| `save_dir` | Optional[str] | `None` |")
        True
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.init:
            meaning = docs.get(f.name, "").replace("``", "`")
            rows.append(f"| `{f.name}` | {type_name(hints.get(f.name, f.type))} | `{_default_text(f)}` | {meaning} |")
    return "\n".join(rows)


def undocumented_fields(cls: Type) -> List[str]:
    """The fields of ``cls`` with no docstring under them (``--help`` and docs/arguments.md would
    have nothing to say about them).

    Example:
        >>> from framework.checkpoint import DefaultCheckpointerArguments
        >>> undocumented_fields(DefaultCheckpointerArguments)
        []
    """
    docs = field_docs(cls)
    return [f.name for f in dataclasses.fields(cls) if f.init and not docs.get(f.name)]


def generated_arguments_doc(text: str) -> str:
    """``text`` (``docs/arguments.md``) with every ``<!-- fields: NAME -->`` block replaced by the table
    of the class NAME (``TrainerArguments`` or ``DefaultCheckpointerArguments``) as the code says it."""
    from framework.checkpoint.arguments import DefaultCheckpointerArguments
    from framework.config.arguments import TrainerArguments

    classes = {cls.__name__: cls for cls in (TrainerArguments, DefaultCheckpointerArguments)}

    def table(match: "re.Match[str]") -> str:
        return f"<!-- fields: {match.group(1)} -->\n{markdown_fields(classes[match.group(1)])}\n<!-- /fields -->"

    return re.sub(r"<!-- fields: (\w+) -->\n.*?<!-- /fields -->", table, text, flags=re.S)
