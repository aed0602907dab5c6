"""The conformance kit: every feature against a backend, on 1 and 2 ranks, compared with ``sp``.

    python -m framework.conformance BACKEND [--import MODULE] [--checks automatic,manual]

See ``docs/backends.md``. :func:`conformance` returns the rows; :func:`format_table` prints them.
"""

from framework.conformance.checks import CHECKS
from framework.conformance.compare import Row
from framework.conformance.runner import conformance, format_table

__all__ = ["CHECKS", "Row", "conformance", "format_table"]
