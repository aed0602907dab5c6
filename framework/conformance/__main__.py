"""``python -m framework.conformance BACKEND [--import MODULE]``: print the table; exit 0 only
when every check passes or is declared unsupported by the backend."""

import argparse
import sys
from typing import List, Optional

from framework.conformance.checks import CHECKS
from framework.conformance.runner import conformance, format_table


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.conformance", description=__doc__)
    parser.add_argument("backend", help="a registered backend name (built-in, entry point, or registered by --import)")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a module name or a .py file) first, so the backend it registers can be named; repeatable",
    )
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of: {', '.join(CHECKS)}")
    parser.add_argument("--ranks", default="1,2", help="world sizes to run, e.g. 1,2 (default) or 2")
    parser.add_argument("--workdir", default=None, help="where runs write (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the multi-rank run may take")
    options = parser.parse_args(argv)
    rows = conformance(
        options.backend,
        imports=options.imports,
        world_sizes=[int(size) for size in options.ranks.split(",")],
        names=[name.strip() for name in options.checks.split(",") if name.strip()],
        workdir=options.workdir,
        timeout=options.timeout,
    )
    print(format_table(options.backend, rows), flush=True)
    return 0 if rows and all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
