"""Slurm hostlist expressions (``node[01-03,07]``, ``a[1-2],b3``) expanded to host names."""

import itertools
import re
from typing import List

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(expression: str) -> List[str]:
    """The host names of a Slurm hostlist expression, in Slurm's order.

    Items are separated by commas outside brackets. An item is text with any number of
    bracket groups; each group lists numbers and ranges, and a range keeps the zero padding
    of its lower bound. Several groups in one item give every combination, first group
    slowest (``r[1-2]n[1-2]`` is ``r1n1, r1n2, r2n1, r2n2``).

    Raises:
        ValueError: unbalanced brackets, an empty item, or a range that is not
            ``low-high`` with ``low <= high``; the message names the expression.

    Example:
        >>> expand_hostlist("node[01-03,07]")
        ['node01', 'node02', 'node03', 'node07']
        >>> expand_hostlist("a[1-2],b3")
        ['a1', 'a2', 'b3']
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError(f"hostlist {expression!r} is invalid; allowed: host names and ranges such as 'node[01-03,07]'")
    hosts: List[str] = []
    for item in _split_top_level(expression.strip()):
        hosts.extend(_expand_item(item, expression))
    return hosts


def first_host(expression: str) -> str:
    """The first host of a hostlist expression (where Slurm puts task 0).

    Example:
        >>> first_host("gpu[3-4,9],cpu1")
        'gpu3'
    """
    return expand_hostlist(expression)[0]


def _split_top_level(expression: str) -> List[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(expression):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {expression!r} is invalid: nested '[' at position {index}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {expression!r} is invalid: ']' without '[' at position {index}")
        elif char == "," and depth == 0:
            items.append(expression[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"hostlist {expression!r} is invalid: '[' is never closed")
    items.append(expression[start:])
    for item in items:
        if not item.strip():
            raise ValueError(f"hostlist {expression!r} is invalid: empty host name between commas")
    return [item.strip() for item in items]


def _expand_item(item: str, expression: str) -> List[str]:
    # "r[1-2]n[3,5]x" -> literal parts ["r", "n", "x"] and groups ["1-2", "3,5"]
    parts = re.split(r"\[([^\]]*)\]", item)
    literals, groups = parts[0::2], parts[1::2]
    choices = [_expand_group(group, expression) for group in groups]
    hosts = []
    for combination in itertools.product(*choices):
        name = literals[0]
        for number, literal in zip(combination, literals[1:]):
            name += number + literal
        hosts.append(name)
    return hosts


def _expand_group(group: str, expression: str) -> List[str]:
    numbers: List[str] = []
    for part in group.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"hostlist {expression!r} is invalid: {part!r} in [{group}] is not a number or a range low-high")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(low) > int(high):
            raise ValueError(f"hostlist {expression!r} is invalid: range {part!r} goes down")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers
