"""Score the conformance kit against the blind faults: run the kit on each fault, print a table.

For every blind fault (``tests/conformance_blind/faults_*.py``) this runs, in a subprocess with a
timeout::

    python -m framework.conformance <name> --import <module> --ranks <1 or 2>

on the kit's default (quick) set (``--all``: every cell), and prints a Markdown table: fault | area
| verdict (killed by which cell / survived / harness error) | and the score killed / total. A
harness error (the kit could not build the backend: "unknown backend", an import failure, a crash
before any cell ran) or a timeout counts as NOT killed.

Usage (from the repository root)::

    PYTHONPATH=$PWD python tests/conformance_blind/score.py                      # every fault, quick set
    PYTHONPATH=$PWD python tests/conformance_blind/score.py --only blind-ddp-barrier-noop,blind-ddp-eval-padded
    PYTHONPATH=$PWD python tests/conformance_blind/score.py --all --timeout 1800
    PYTHONPATH=$PWD python tests/conformance_blind/score.py --controls           # the correct controls too

It is a scoring tool, not a test: nothing in CI runs it.
"""

import argparse
import concurrent.futures
import datetime
import importlib
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ROW = re.compile(r"^(?P<cell>\S+/\S+)\s+(?P<ranks>\d+)\s+(?P<result>PASS|FAIL|REFUSED|KNOWN|FIXED)\s+(?P<figure>.*?)\s*$")
HARNESS_MARKS = ("unknown backend", "ModuleNotFoundError", "ImportError", "No module named", "cannot import")


@dataclass
class Verdict:
    name: str
    area: str
    control: str
    ranks: int
    outcome: str  # "killed", "survived", "harness error", "timeout" ("not run": rebuilt from logs without it)
    detail: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.outcome == "killed"


def load_faults() -> Dict[str, object]:
    from tests import conformance_blind

    for module in conformance_blind.MODULES:
        importlib.import_module(module)
    return dict(conformance_blind.FAULTS)


def kit_command(
    name: str, module: str, ranks: int, every_cell: bool, as_path: bool = False, kit_args: Sequence[str] = ()
) -> List[str]:
    """The kit's command line (``ranks``: 1, 2 or 4; ``kit_args``: the fault's own extra arguments);
    ``as_path``: ``--import tests/conformance_blind/<file>.py`` instead of the module name."""
    target = module.replace(".", "/") + ".py" if as_path and module.startswith("tests.") else module
    command = [sys.executable, "-m", "framework.conformance", name, "--import", target, "--ranks", str(ranks), *kit_args]
    return [*command, "--all"] if every_cell else command


def judge(name: str, returncode: Optional[int], output: str) -> "tuple[str, str]":
    """(outcome, detail) from the kit's exit status and output."""
    if returncode is None:
        return "timeout", "the kit ran past the timeout (not killed)"
    rows = [match.groupdict() for match in map(ROW.match, output.splitlines()) if match]
    failed = [row for row in rows if row["result"] == "FAIL"]
    lowered = output.lower()
    if any(mark.lower() in lowered for mark in HARNESS_MARKS) and (
        not rows or all(any(mark.lower() in row["figure"].lower() for mark in HARNESS_MARKS) for row in failed)
    ):
        line = next((line for line in output.splitlines() if any(m.lower() in line.lower() for m in HARNESS_MARKS)), "")
        return "harness error", line.strip()[:160]
    if failed:
        first = failed[0]
        more = f" (+{len(failed) - 1} more of {len(rows)} cells)" if len(failed) > 1 else f" (1 of {len(rows)} cells)"
        figure = re.split(r"\s{2,}", first["figure"])[0].replace("|", "\\|")[:110]
        return "killed", f"{first['cell']} ({first['ranks']}){more}: {figure}"
    if returncode == 0 and rows:
        return "survived", f"{len(rows)} cells passed"
    tail = next((line for line in reversed(output.strip().splitlines()) if line.strip()), "no output")
    return "harness error", f"exit {returncode}, no failing cell: {tail.strip()[:160]}"


def run_one(
    name: str,
    module: str,
    ranks: int,
    area: str,
    control: str,
    every_cell: bool,
    timeout: float,
    as_path: bool = False,
    kit_args: Sequence[str] = (),
) -> Verdict:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [environment.get("PYTHONPATH")])])
    started = time.monotonic()
    try:
        completed = subprocess.run(
            kit_command(name, module, ranks, every_cell, as_path, kit_args),
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        returncode: Optional[int] = completed.returncode
        output = completed.stdout
    except subprocess.TimeoutExpired as expired:
        returncode, output = None, (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else ""
    outcome, detail = judge(name, returncode, output)
    return Verdict(name, area, control, ranks, outcome, detail, time.monotonic() - started)


def markdown(verdicts: Sequence[Verdict], every_cell: bool) -> str:
    lines = [
        "| fault | area | control | ranks | verdict | seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for verdict in verdicts:
        text = {
            "killed": f"killed by {verdict.detail}",
            "survived": f"survived ({verdict.detail})",
            "harness error": f"harness error, not a kill: {verdict.detail}",
            "timeout": f"timeout, not a kill: {verdict.detail}",
            "not run": "not run (no result in the logs; not a kill)",
        }[verdict.outcome]
        lines.append(
            f"| `{verdict.name}` | {verdict.area} | `{verdict.control}` | {verdict.ranks} | {text} | {verdict.seconds:.0f} |"
        )
    killed = sum(verdict.killed for verdict in verdicts)
    errors = sum(verdict.outcome in ("harness error", "timeout") for verdict in verdicts)
    missing = sum(verdict.outcome == "not run" for verdict in verdicts)
    total = len(verdicts)
    share = f"{100 * killed / total:.0f}%" if total else "n/a"
    lines += [
        "",
        f"Score ({'--all' if every_cell else 'quick set'}): **{killed} of {total} killed** ({share}); "
        f"{total - killed - errors - missing} survived, {errors} harness error(s) or timeout(s) (counted as not killed)"
        + (f", {missing} not run (counted as not killed)." if missing else "."),
    ]
    return "\n".join(lines)


LOG_LINE = re.compile(
    r"^# (?P<name>\S+) \((?P<ranks>\d+) rank\(s\)\): "
    r"(?P<outcome>killed|survived|harness error|timeout): (?P<detail>.*) \[(?P<seconds>\d+) s\]$"
)


def rebuild(logs: Sequence[str], faults: Dict[str, object], names: Sequence[str], every_cell: bool, out: str) -> int:
    """The table from the per-fault lines of earlier runs (the last line of a fault wins); faults
    with no line are listed as not run (not killed)."""
    found: Dict[str, Verdict] = {}
    for log in logs:
        with open(log) as handle:
            for line in handle:
                match = LOG_LINE.match(line.rstrip("\n"))
                if match and match["name"] in faults:
                    entry = faults[match["name"]]
                    detail = match["detail"]  # already escaped for Markdown
                    found[match["name"]] = Verdict(
                        match["name"],
                        entry.area,
                        entry.control,
                        int(match["ranks"]),  # type: ignore[attr-defined]
                        match["outcome"],
                        detail,
                        float(match["seconds"]),
                    )
    verdicts = []
    for name in names:
        entry = faults[name]
        verdicts.append(
            found.get(name) or Verdict(name, entry.area, entry.control, entry.ranks, "not run", "", 0.0)  # type: ignore[attr-defined]
        )
    table = markdown(verdicts, every_cell)
    print(table)
    if out:
        with open(out, "w") as handle:
            handle.write(table + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated fault names (default: every blind fault)")
    parser.add_argument("--all", action="store_true", help="pass --all to the kit (every cell, not the quick set)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per fault (default 900)")
    parser.add_argument("--jobs", type=int, default=1, help="faults run at once (default 1: the kit is CPU-heavy)")
    parser.add_argument("--controls", action="store_true", help="also run each fault's correct control on the same set")
    parser.add_argument("--out", default="", help="also write the table to this file")
    parser.add_argument(
        "--from-log",
        nargs="+",
        default=[],
        help="rebuild the table from the '# <fault> (...): <verdict>' lines of earlier runs' output (no kit run)",
    )
    parser.add_argument(
        "--import-as-path", action="store_true", help="--import tests/conformance_blind/<file>.py (default: the module name)"
    )
    options = parser.parse_args(argv)

    faults = load_faults()
    names = [name.strip() for name in options.only.split(",") if name.strip()] or list(faults)
    unknown = [name for name in names if name not in faults]
    if unknown:
        parser.error(f"unknown blind fault(s): {', '.join(unknown)}; known: {', '.join(faults)}")
    jobs = []
    for name in names:
        entry = faults[name]
        jobs.append((name, entry.module, entry.ranks, entry.area, entry.control, entry.kit_args))  # type: ignore[attr-defined]
    if options.controls:
        from tests import conformance_blind

        seen = set()
        for name in names:
            entry = faults[name]
            control = entry.control.split()[0]  # type: ignore[attr-defined]
            key = (control, entry.ranks)  # type: ignore[attr-defined]
            if key not in seen:
                seen.add(key)
                module = "tests.conformance_blind.controls" if control in conformance_blind.CONTROLS else "backends"
                jobs.append((control, module, entry.ranks, "control", "(itself)", entry.kit_args))  # type: ignore[attr-defined]

    started = datetime.datetime.now(datetime.timezone.utc)
    if options.from_log:
        return rebuild(options.from_log, faults, names, options.all, options.out)
    print(
        f"# blind faults: {len(jobs)} run(s), {'--all' if options.all else 'quick set'}, up to {options.jobs} at once", flush=True
    )
    verdicts: Dict[str, Verdict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        futures = {
            pool.submit(
                run_one, name, module, ranks, area, control, options.all, options.timeout, options.import_as_path, kit_args
            ): f"{name}@{ranks}"
            for name, module, ranks, area, control, kit_args in jobs
        }
        for future in concurrent.futures.as_completed(futures):
            verdict = future.result()
            verdicts[futures[future]] = verdict
            print(
                f"# {verdict.name} ({verdict.ranks} rank(s)): {verdict.outcome}: {verdict.detail} [{verdict.seconds:.0f} s]",
                flush=True,
            )
    ordered = [verdicts[f"{name}@{ranks}"] for name, _, ranks, _, _, _ in jobs]
    faults_only = [verdict for verdict in ordered if verdict.area != "control"]
    table = markdown(faults_only, options.all)
    controls = [verdict for verdict in ordered if verdict.area == "control"]
    if controls:
        table += "\n\nControls (must survive: a control that fails makes its faults' kills suspect):\n\n"
        table += "\n".join(f"- `{v.name}` ({v.ranks} rank(s)): {v.outcome}: {v.detail}" for v in controls)
    header = (
        f"Run {started:%Y-%m-%d %H:%M} UTC on {platform.node() or 'this machine'} ({os.cpu_count()} CPU cores, "
        f"{platform.python_implementation()} {platform.python_version()})."
    )
    print()
    print(header)
    print()
    print(table)
    if options.out:
        with open(options.out, "w") as handle:
            handle.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
