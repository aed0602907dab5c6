"""Every ```python block of README.md and docs/*.md runs as written, on its own.

Each block is written to a file in a fresh temporary directory and run there in a new
Python process (``PYTHONPATH`` = the repository root), so a block cannot lean on another
block, on files a previous run left behind, or on names defined in the test. A block that
is deliberately not runnable is written with another fence (```text, ```bash, ...) and, when it
looks like Python, says so on its first line (``# a fragment ...`` or ``# pseudo-code ...``).
A number in a ``print(...)  # 0.9259 on torch ...`` comment is what the block prints.

The blocks are single-process programs each alone in its directory, so the selected ones run two
at a time (the test process only waits on them): each test still checks its own block's result.
"""

import concurrent.futures
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_ANY_BLOCK = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_LOOKS_LIKE_PYTHON = re.compile(r"^(from \w[\w.]* import |import \w|class \w+\(|def \w+\()|Trainer\(", re.MULTILINE)
_PRINTED = re.compile(r"^print\(.*\)\s+#\s*(-?[0-9]+\.[0-9]+) on torch", re.MULTILINE)


def python_blocks():
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as handle:
            text = handle.read()
        for number, match in enumerate(_BLOCK.finditer(text), start=1):
            line = text.count("\n", 0, match.start()) + 2
            yield pytest.param(match.group(1), id=f"{page}:{line}#{number}")


BLOCKS = list(python_blocks())


def test_the_pages_have_python_blocks():
    assert len(BLOCKS) >= 10  # the README's module, getting started, callbacks, metrics, ...


def _run_block(code, directory):
    script = directory / "snippet.py"
    script.write_text(code)
    environment = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, str(script)], cwd=directory, env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def block_results(request, tmp_path_factory):
    """The selected blocks started two at a time, each in its own process and directory: test id -> future."""
    selected = [
        item
        for item in request.session.items
        if item.parent is request.node and item.originalname == "test_block_runs_standalone"
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            item.callspec.id: pool.submit(_run_block, item.callspec.params["code"], tmp_path_factory.mktemp("block"))
            for item in selected
        }
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_standalone(code, block_results, request):
    result = block_results[request.node.callspec.id].result()
    assert result.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"
    for number in _PRINTED.findall(code):  # the figure the page shows is the one printed
        assert number in result.stdout, f"the page says {number}, the block printed:\n{result.stdout}"


def test_a_block_that_looks_runnable_is_a_python_block_or_says_it_is_a_fragment():
    hidden = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as handle:
            text = handle.read()
        for match in _ANY_BLOCK.finditer(text):
            language, body = match.groups()
            marked = body.lstrip().startswith(("# a fragment", "# pseudo-code"))
            if language != "python" and _LOOKS_LIKE_PYTHON.search(body) and not marked:
                hidden.append(f"{page}:{text.count(chr(10), 0, match.start()) + 1}")
    assert hidden == [], f"python-looking blocks that do not run: fence them as python (and make them run) or mark them {hidden}"
