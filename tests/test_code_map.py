"""tests/README.md's "Which file tests what" map covers every module of framework/ and backends/,
and every test file it names exists: a new module without a row, or a row left behind by a move,
fails here instead of drifting."""

import os
import re
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "tests", "README.md")
PACKAGES = ("framework", "backends")
_CODE = re.compile(r"`([\w./-]+)`")


def source_modules() -> Set[str]:
    """Every module file of framework/ and backends/ (package ``__init__``/``__main__`` files left out)."""
    found = set()
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                    found.add(os.path.relpath(os.path.join(directory, name), ROOT).replace(os.sep, "/"))
    return found


def map_rows(text: str) -> List[Tuple[str, str]]:
    """The (code, test file) cells of the map's table."""
    section = text.split("## Which file tests what", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and line.startswith("|") and not set(cells[0]) <= {"-", " "} and cells[0] != "code":
            rows.append((cells[0], cells[1]))
    return rows


def covered(code_cell: str, modules: Set[str]) -> Set[str]:
    """The modules one code cell names: full paths (``framework/loop/trainer.py``), folders
    (``framework/callbacks/``: all of it), paths under a package (``checkpoint/finite.py``), and bare
    names (``recorder.py``) in the folder of the full path before them in the cell."""
    names, folder = set(), None
    for token in _CODE.findall(code_cell):
        if token.endswith("/"):
            if token.strip("/") in PACKAGES:
                continue  # "no import circle in `framework/`" is about the whole house, not a map row
            prefixes = [token] if token.startswith(PACKAGES) else [f"{package}/{token}" for package in PACKAGES]
            names.update(module for module in modules for prefix in prefixes if module.startswith(prefix))
            continue
        if not token.endswith(".py"):
            continue
        if token.startswith(PACKAGES):
            candidates, folder = [token], os.path.dirname(token)
        elif "/" in token:
            candidates = [f"{package}/{token}" for package in PACKAGES]
        else:
            candidates = [f"{folder}/{token}"] if folder else []
        for candidate in candidates:
            if candidate in modules:
                names.add(candidate)
                folder = os.path.dirname(candidate)
    return names


def named_test_files(test_cell: str) -> Set[str]:
    return {token for token in _CODE.findall(test_cell) if token.endswith(".py") and "test_" in token}


def coverage(text: str, modules: Set[str]) -> Dict[str, Set[str]]:
    """{module: the test files its rows name}."""
    tests: Dict[str, Set[str]] = {module: set() for module in modules}
    for code_cell, test_cell in map_rows(text):
        for module in covered(code_cell, modules):
            tests[module] |= named_test_files(test_cell) or {"(row without a test file)"}
    return tests


def test_every_module_has_a_row_naming_its_test_file():
    with open(README) as handle:
        text = handle.read()
    unmapped = sorted(module for module, tests in coverage(text, source_modules()).items() if not tests)
    assert unmapped == [], "add a row to tests/README.md's map for each: " + ", ".join(unmapped)


def test_every_test_file_the_map_names_exists():
    with open(README) as handle:
        text = handle.read()
    named = set().union(*(named_test_files(test_cell) for _, test_cell in map_rows(text)))
    missing = sorted(name for name in named if not os.path.exists(os.path.join(ROOT, "tests", name)))
    assert missing == []


def test_a_module_without_a_row_is_found():
    """The check itself: a module the map does not name is reported; a folder row covers its files."""
    modules = {"framework/loop/trainer.py", "framework/loop/new_part.py", "framework/metrics/recorder.py"}
    text = (
        "## Which file tests what\n\n| code | test file |\n| --- | --- |\n"
        "| `framework/loop/trainer.py`, `framework/metrics/collector.py`, `recorder.py` | `test_training_loop.py` |\n"
    )
    assert {module for module, tests in coverage(text, modules).items() if not tests} == {"framework/loop/new_part.py"}
    assert not [m for m, tests in coverage(text + "| `framework/loop/` | `test_x.py` |\n", modules).items() if not tests]
