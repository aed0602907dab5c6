"""The run's configuration: arguments and their typed fields, the YAML reader and writer, the command
line (``cli.py``: ``parse_config``), class paths, ``--help``, hyper-parameters.

``framework.config`` was once the command-line module itself (now ``framework.config.cli``): its names
still resolve here, with a ``FutureWarning`` naming the new path.

Example:
    >>> from framework.config.arguments import TrainerArguments
    >>> TrainerArguments(epochs=2).epochs
    2
"""

import importlib
import warnings
from typing import Any

# the names the old module framework.config exported (framework.config.cli's __all__)
_OLD_MODULE_NAMES = ("ConfigError", "RunConfig", "convert", "format_help", "parse_config", "resolved_config", "suggest")


def __getattr__(name: str) -> Any:
    if name in _OLD_MODULE_NAMES:
        message = f"framework.config.{name} is deprecated: import framework.config.cli.{name} instead"
        warnings.warn(message, FutureWarning, stacklevel=2)
        return getattr(importlib.import_module("framework.config.cli"), name)
    raise AttributeError(f"module 'framework.config' has no attribute {name!r}")
