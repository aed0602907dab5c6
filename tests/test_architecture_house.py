"""The house by concern keeps its split: the configuration in framework/config/, the run directory,
identity and lock in framework/run/, the process lifecycle in framework/lifecycle/; nothing of the
project reaches a module by a path that moved (those stay only as deprecated aliases for users)."""

import ast
import os
import re
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import framework.config
from framework.deprecated_paths import MOVED_MODULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ("framework", "backends", "tests", "benchmarks", "examples")
# where old paths are named on purpose: the alias table and the tests of the aliases
ALIAS_FILES = {
    "framework/deprecated_paths.py",
    "backends/moved_modules.py",
    "tests/test_public_api.py",
    "tests/test_architecture_house.py",
}
# old paths: the moved modules, and the names of the old module framework.config (a package now)
OLD_PATHS = set(MOVED_MODULES) | {f"framework.config.{name}" for name in framework.config._OLD_MODULE_NAMES}
_DOTTED = re.compile(r"\b(?:framework|backends)(?:\.\w+)+")


def python_files(folders: Tuple[str, ...]) -> Iterator[str]:
    for folder in folders:
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(directory, name), ROOT).replace(os.sep, "/")


def named_modules(source: str) -> Set[str]:
    """Every module path a file names: what it imports (``from a import b`` names ``a`` and ``a.b``)
    and the dotted paths in its strings (``mock.patch("framework.x.y")``, ``python -m framework.x``)."""
    named = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for dotted in _DOTTED.findall(node.value):
                parts = dotted.split(".")
                named.update(".".join(parts[:end]) for end in range(2, len(parts) + 1))
    return named


def old_paths_named(path: str, source: str) -> List[str]:
    return sorted(named for named in named_modules(source) if named in OLD_PATHS)


def test_no_file_of_the_project_names_a_moved_module_path():
    """The project uses the new paths; the old ones are for users' code, which gets a warning.
    A file found here imports the path on the left of framework/deprecated_paths.py's table: use the right."""
    offenders: Dict[str, List[str]] = {}
    for path in python_files(CODE):
        if path in ALIAS_FILES:
            continue
        with open(os.path.join(ROOT, path)) as handle:
            found = old_paths_named(path, handle.read())
        if found:
            offenders[path] = found
    assert offenders == {}


def test_the_check_finds_an_import_of_an_old_path():
    source = "from framework.run.arguments import TrainerArguments\nfrom framework.run import preemption\n"
    assert old_paths_named("framework/x.py", source) == ["framework.run.arguments", "framework.run.preemption"]
    assert old_paths_named("x.py", 'patch("framework.run.config.load")') == ["framework.run.config"]
    assert old_paths_named("x.py", "from framework.config import parse_config") == ["framework.config.parse_config"]
    assert old_paths_named("x.py", "from framework.run import run_lock\nimport framework.config.cli\n") == []


def test_the_docs_name_no_moved_source_file():
    """docs/, CONTRIBUTING and tests/README name the files where they are now."""
    old_files = {old.replace(".", "/") + ".py" for old in MOVED_MODULES}
    pages = ["CONTRIBUTING.md", "README.md", "tests/README.md"]
    pages += [f"docs/{name}" for name in sorted(os.listdir(os.path.join(ROOT, "docs"))) if name.endswith(".md")]
    offenders = {}
    for page in pages:
        with open(os.path.join(ROOT, page)) as handle:
            text = handle.read()
        found = sorted(name for name in old_files if re.search(rf"(?<![\w/]){re.escape(name)}", text))
        if found:
            offenders[page] = found
    assert offenders == {}


def _project_imports(package: str) -> Dict[str, Set[str]]:
    """{file under framework/<package>/: the framework modules it imports} (strings left out)."""
    graph = {}
    for path in python_files((f"framework/{package}",)):
        with open(os.path.join(ROOT, path)) as handle:
            tree = ast.parse(handle.read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[path] = {target for target in targets if target.startswith("framework.")}
    return graph


# The run directory's machinery: the lock, its takeover, the claim of version_<N>, shared storage.
RUN_MACHINERY = {
    "framework.run.run_lock",
    "framework.run.lock_file",
    "framework.run.lock_takeover",
    "framework.run.run_directory",
    "framework.run.run_claim",
    "framework.run.shared_storage",
    "framework.run.finished_run",
}
# The configuration's front: the command line, class paths, --help, the YAML writer, conversions.
CONFIG_FRONT = {
    "framework.config.cli",
    "framework.config.class_path",
    "framework.config.help",
    "framework.config.conversion",
    "framework.config.yaml_text",
    "framework.config.lightning_names",
    "framework.config.backend_options",
}


def crossings(graph: Dict[str, Set[str]], forbidden: Set[str]) -> Dict[str, List[str]]:
    found = {path: sorted(targets & forbidden) for path, targets in graph.items()}
    return {path: names for path, names in found.items() if names}


def test_the_config_holds_no_lock_or_run_directory_code():
    """framework/config/ reads and writes settings; it neither takes a lock nor claims a directory
    (the run id's key name in config.yaml is all it reads of the run)."""
    assert crossings(_project_imports("config"), RUN_MACHINERY) == {}
    files = {os.path.basename(path) for path in python_files(("framework/config",))}
    assert not {name for name in files if re.search(r"lock|claim|directory|storage", name)}


def test_the_run_directory_holds_no_command_line_or_config_code():
    """framework/run/ is the run on disk: it uses the arguments and the YAML reader, never the CLI."""
    assert crossings(_project_imports("run"), CONFIG_FRONT) == {}
    files = {os.path.basename(path) for path in python_files(("framework/run",))}
    assert not {name for name in files if re.search(r"config|cli|yaml|argument|preemption|launcher|logging", name)}


def test_lifecycle_and_config_never_import_the_loop():
    """Preemption, the launcher watch and logging serve the loop and the arguments: they import
    neither the loop nor the run directory, so anything may use them."""
    for package in ("lifecycle", "config"):
        graph = _project_imports(package)
        loop = {path: sorted(t for t in targets if t.startswith("framework.loop")) for path, targets in graph.items()}
        assert {path: names for path, names in loop.items() if names} == {}, package


@pytest.mark.parametrize("old", sorted(old for old in MOVED_MODULES if old.startswith("framework.run.")))
def test_a_moved_file_is_gone_from_its_old_folder(old):
    """The old file is gone (one copy of each module); its path resolves only through the alias."""
    assert not os.path.exists(os.path.join(ROOT, old.replace(".", "/") + ".py"))
