"""Capturing what the framework logs (its loggers do not propagate to pytest's caplog)."""

import logging
from contextlib import contextmanager
from typing import Iterator, List


@contextmanager
def captured_log(name: str = "framework") -> Iterator[List[str]]:
    """Messages that reach logger ``name`` (and its children) at the levels it lets through."""
    messages: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
