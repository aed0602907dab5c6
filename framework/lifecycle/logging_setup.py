"""Framework log messages: printed on rank zero only."""

import logging
import sys


def configure_logging(level: str, is_main_process: bool) -> None:
    """Send the ``framework`` and ``backends`` loggers to stderr on rank zero; silence other ranks
    below ERROR."""
    for name in ("framework", "backends"):
        log = logging.getLogger(name)
        log.setLevel(level.upper() if is_main_process else logging.ERROR)
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S"))
            log.addHandler(handler)
            log.propagate = False
