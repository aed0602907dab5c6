"""Every ```python block of README.md and docs/*.md runs as written, on its own.

Each block is written to a file in a fresh temporary directory and run there in a new
Python process (``PYTHONPATH`` = the repository root), so a block cannot lean on another
block, on files a previous run left behind, or on names defined in the test. A block that
is deliberately not runnable is written with another fence (```text, ```bash, ...).
"""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


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


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_standalone(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    environment = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"
