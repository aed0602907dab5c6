"""The one door for run files (``backends/checkpoint_io/run_files.py``): no other code in framework/
or backends/ opens or loads a file, and the door refuses every odd file of every kind it reads.

Faults caught: a raw ``open``/``torch.load``/``fs.open`` added anywhere else (the scanner's own
mutant test below plants one); a read that follows a symlink, blocks on a FIFO, reads ``/dev/zero``
until memory runs out, or reads a file past its kind's limit; a write through a symlink.
"""

import ast
import os
import threading

import pytest

from backends.checkpoint_io import run_files
from backends.checkpoint_io.local_files import LocalFiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOOR = "backends/checkpoint_io/run_files/"

OPENERS = {"open", "os.open", "os.fdopen", "io.open", "codecs.open", "fsspec.open", "fsspec.open_files", "np.load"}
OPENERS |= {"numpy.load", "torch.load", "pickle.load", "json.load", "safe_open", "load_file", "mmap.mmap"}
PARSERS = {"yaml.safe_load", "yaml.load", "yaml.full_load", "yaml.unsafe_load", "yaml.safe_load_all", "pickle.loads"}
METHODS = {"open", "read_text", "read_bytes", "write_text", "write_bytes"}  # fs.open, pathlib's readers and writers

ALLOWED = {
    # module: (calls it may make, why)
    "framework/config/bounded_yaml.py": ({"yaml.safe_load", "yaml.load"}, "the bounded YAML parser: text in, data out"),
    "backends/checkpoint_io/dcp_reader.py": ({"pickle.loads"}, "index bytes read by the door, unpickled only when trusted"),
    "backends/plugins.py": ({".read_text"}, "installed packages' entry_points.txt (importlib.metadata), no run file"),
    "framework/conformance/ranks.py": ({"open", "torch.load", "torch.save"}, "the kit's own results, not a run's files"),
    "framework/conformance/report.py": ({"open"}, "the kit's markdown report (--write), not a run's file"),
    "framework/conformance/features_resume.py": ({"open"}, "the kit damages a checkpoint on purpose (its fault cell)"),
}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _proc_path(call: ast.Call) -> bool:
    """``open("/proc/...")`` or ``open(f"/proc/{pid}/stat")``: the kernel's files, not a run's."""
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value.startswith("/proc/")
    if isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant):
        return str(first.values[0].value).startswith("/proc/")
    return False


def raw_file_calls(source: str) -> list:
    """``[(line, call)]`` of the calls in ``source`` that open, load or save a file by themselves."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        short = name.rsplit(".", 1)[-1]
        if name.startswith("run_files."):  # the door itself
            continue
        if name in OPENERS | PARSERS and not (name == "open" and _proc_path(node)):
            found.append((node.lineno, name))
        elif name == "torch.save" and not (len(node.args) > 1 and _name(node.args[1]) == "handle"):
            found.append((node.lineno, name))  # to a path: opens the file itself
        elif isinstance(node.func, ast.Attribute) and short in METHODS and name not in ("os.open",):
            found.append((node.lineno, "." + short))
    return found


def test_no_code_outside_the_door_opens_or_loads_a_file():
    offenders = {}
    for package in ("framework", "backends"):
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)
                if module.startswith(DOOR):
                    continue
                with open(path) as handle:
                    calls = raw_file_calls(handle.read())
                allowed = ALLOWED.get(module, (set(), ""))[0]
                calls = [(line, call) for line, call in calls if call not in allowed]
                if calls:
                    offenders[module] = calls
    assert offenders == {}, "open and load run files through backends/checkpoint_io/run_files/"


@pytest.mark.parametrize(
    "mutant",
    [
        "with open(path) as handle:\n    text = handle.read()",
        "data = torch.load(path, weights_only=True)",
        "with fs.open(path, 'rb') as handle:\n    pass",
        "torch.save(state, path)",
        "config = yaml.safe_load(text)",
        "descriptor = os.open(path, os.O_RDONLY)",
    ],
)
def test_the_scanner_finds_a_raw_open_planted_in_a_module(mutant):
    """The mutant: a raw read or write added to a module; the scan above must name it."""
    assert raw_file_calls(f"import os\n{mutant}\n"), mutant
    assert raw_file_calls('open("/proc/stat")\nopen(f"/proc/{pid}/stat")\ntorch.save(state, handle)\n') == []


def _hostile(tmp_path, attack):
    """A file named ``victim`` in ``tmp_path`` set up as ``attack``; returns its path."""
    path = str(tmp_path / "victim")
    if attack == "symlink out of the run":
        outside = tmp_path / "outside.txt"
        outside.write_bytes(b"secret")
        os.symlink(outside, path)
    elif attack == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif attack == "fifo":
        os.mkfifo(path)
    elif attack == "directory":
        os.mkdir(path)
    return path


ATTACKS = ["symlink out of the run", "symlink to /dev/zero", "fifo", "directory"]


@pytest.mark.parametrize("kind", run_files.KINDS, ids=[kind.name for kind in run_files.KINDS])
@pytest.mark.parametrize("attack", ATTACKS)
def test_every_kind_refuses_every_odd_file_without_hanging(tmp_path, kind, attack):
    """Faults: a read through a link (O_NOFOLLOW dropped), a blocking open of a FIFO (O_NONBLOCK
    dropped: the test's thread would never return), a device read to exhaustion (the fstat check dropped)."""
    path = _hostile(tmp_path, attack)
    outcome = {}

    def attempt():
        try:
            run_files.read_bytes(LocalFiles(), path, kind)
            outcome["read"] = True
        except Exception as error:
            outcome["error"] = error

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), f"reading a {attack} as a {kind.name} hung"
    assert isinstance(outcome.get("error"), kind.error), outcome
    assert path in str(outcome["error"]) and kind.name in str(outcome["error"])


BOUNDED = [kind for kind in run_files.KINDS if kind.limit <= 1 << 30]  # the others: a real file system's own limit


@pytest.mark.parametrize("kind", BOUNDED, ids=[kind.name for kind in BOUNDED])
def test_a_file_over_its_kind_limit_is_refused_before_it_is_read(tmp_path, kind):
    """Fault: the size check dropped (a sparse file one byte over the limit would be read whole)."""
    path = str(tmp_path / "victim")
    with open(path, "wb") as handle:
        handle.truncate(kind.limit + 1)  # sparse: no disk, no time
    with pytest.raises(kind.error, match=f"is {kind.limit + 1} bytes"):
        run_files.read_bytes(LocalFiles(), path, kind)
    with open(path, "r+b") as handle:
        handle.truncate(min(kind.limit, 1 << 12))
    assert len(run_files.read_bytes(LocalFiles(), path, kind)) == min(kind.limit, 1 << 12)


def test_a_write_replaces_a_symlink_and_never_changes_its_target(tmp_path):
    """Fault: a write that opens the target for writing (follows the link, truncates the user's file)."""
    users_own = tmp_path / "my_config.yaml"
    users_own.write_text("mine: 1\n")
    link = tmp_path / "config.yaml"
    os.symlink(users_own, link)
    run_files.write_bytes(str(link), b"run: 2\n", run_files.CONFIG)
    assert users_own.read_text() == "mine: 1\n"
    assert not os.path.islink(link) and link.read_text() == "run: 2\n"
    assert [name for name in os.listdir(tmp_path) if name.endswith(run_files.TEMPORARY_SUFFIX)] == []


def test_listing_leaves_symlinks_out(tmp_path):
    (tmp_path / "checkpoint-000000002.pt").write_bytes(b"x")
    os.symlink(tmp_path / "checkpoint-000000002.pt", tmp_path / "checkpoint-000000099.pt")
    os.mkdir(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "checkpoint-000000098")
    names = sorted(os.path.basename(path) for path in run_files.list_entries(LocalFiles(), str(tmp_path)))
    assert names == ["checkpoint-000000002.pt", "elsewhere"]
