"""The house's shape: no import circle inside framework/ or backends/ (TYPE_CHECKING imports
included), backends/ never imports framework/, backends/ is grouped by concern, no file over 450 lines."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imports_of(package: str):
    """{module: set of modules of the project it imports}, read from the source (no import runs)."""
    graph = {}
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            targets = set()
            with open(path) as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets.add(node.module)
                    targets.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
            graph[module] = targets
    return graph


def cycles(graph):
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["framework", "backends"])
def test_no_import_circle(package):
    graph = imports_of(package)
    # A package's __init__ re-exporting its modules is not a circle of the design: leave the
    # edges from a module to the package that contains it out (framework.x.y -> framework.x).
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    assert cycles(graph) == []


def test_backends_are_grouped_by_concern():
    """At most about ten modules at the top of backends/ (the facade, registry, options, plugins,
    the moved paths); everything else in a subpackage named by its concern."""
    top = sorted(name for name in os.listdir(os.path.join(ROOT, "backends")) if name.endswith(".py"))
    packages = sorted(
        name
        for name in os.listdir(os.path.join(ROOT, "backends"))
        if os.path.isfile(os.path.join(ROOT, "backends", name, "__init__.py"))
    )
    assert len(top) <= 10, top
    assert packages == ["checkpoint_io", "data", "environments", "precision", "strategies"]


def test_backends_do_not_import_framework():
    graph = imports_of("backends")
    offenders = {module: sorted(t for t in targets if t.split(".")[0] == "framework") for module, targets in graph.items()}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_no_file_over_450_lines():
    long = {}
    for package in ("framework", "backends"):
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    with open(path) as handle:
                        lines = sum(1 for _ in handle)
                    if lines > 450:
                        long[os.path.relpath(path, ROOT)] = lines
    assert long == {}
