"""The house's shape: no import circle inside framework/ or backends/ (TYPE_CHECKING imports
included), backends/ never imports framework/, backends/ is grouped by concern, no file over 450 lines,
the trainer composed of parts it holds (no mixins)."""

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


TRAINER_PARTS = {  # the trainer's field -> the module of its class
    "training_setup": "framework.loop.training_setup",
    "checkpoint_manager": "framework.loop.checkpoint_manager",
    "run_start": "framework.loop.run_start",
    "run_claim": "framework.run.run_claim",
    "evaluation": "framework.evaluation.trainer_evaluation",
    "training_step": "framework.loop.training_step",
}


def test_the_trainer_holds_its_parts_and_inherits_none(tmp_path):
    """``class Trainer`` has no base class sharing its state (no mixins); each part is a field whose
    module does not import the trainer; the names callbacks read are the owning part's values."""
    from toy import ToyModule, toy_args

    from framework import Trainer, TrainerArguments

    assert Trainer.__bases__ == (object,)
    graph = imports_of("framework")
    assert {part: "framework.loop.trainer" in graph[module] for part, module in TRAINER_PARTS.items()} == dict.fromkeys(
        TRAINER_PARTS, False
    )
    trainer = Trainer(ToyModule(), toy_args(tmp_path, epochs=1))
    assert isinstance(trainer.args, TrainerArguments)
    for part, module in TRAINER_PARTS.items():
        assert type(getattr(trainer, part)).__module__ == module, part
    trainer.train()
    assert trainer.optimizers is trainer.training_setup.optimizers and trainer.optimizers
    assert trainer.run_id == trainer.checkpoint_manager.run_id is not None
    with pytest.raises(AttributeError, match=r"Trainer\.optimizers is read-only: it belongs to Trainer\.training_setup"):
        trainer.optimizers = []  # type: ignore[misc]
