"""Resuming a run that has already finished: say so, and which settings differ from its own.

A finished run resumed (``resume="auto"``) with fewer epochs, another backend or the same
command trains nothing. Without a word it would print the old metrics and exit 0; instead
the trainer logs "finished at step N; nothing to do" with the settings that differ from the
run's ``config.yaml`` (read before this run rewrites it).
"""

import logging
from typing import Any, Dict, List, Optional

from framework.config.bounded_repr import bounded_repr

logger = logging.getLogger("framework")

IGNORED = frozenset({"log_level", "disable_tqdm", "resume", "run_id"})
"""Settings that do not change what a run trains."""


def changed_settings(config_path: str, current: Dict[str, Dict[str, Any]]) -> List[str]:
    """``"trainer.epochs: 3 -> 2"`` for each setting in ``current`` (a ``RunConfig.to_dict()``)
    that differs from the YAML at ``config_path``; empty when there is none or no readable file.

    Example:
        >>> import os, tempfile, yaml
        >>> path = os.path.join(tempfile.mkdtemp(), "config.yaml")
        >>> with open(path, "w") as handle:
        ...     yaml.safe_dump({"trainer": {"epochs": 3, "backend": "ddp"}}, handle)
        >>> changed_settings(path, {"trainer": {"epochs": 2, "backend": "ddp"}})
        ['trainer.epochs: 3 -> 2']
    """
    from backends.checkpoint_io import run_files  # the one door for files

    try:
        text = run_files.read_text(config_path, run_files.CONFIG)
    except (OSError, run_files.UnsafeRunFile):
        return []
    from framework.config.bounded_yaml import YamlRefused, load_yaml  # only when there is a file

    try:
        saved = load_yaml(text)  # an alias bomb is refused, not walked
    except YamlRefused:
        return []
    if not isinstance(saved, dict):
        return []
    changes = []
    for section, values in current.items():
        before = saved.get(section)
        if not isinstance(before, dict) or not isinstance(values, dict):
            continue
        for key, value in values.items():
            if key not in IGNORED and key in before and before[key] != value:
                changes.append(f"{section}.{key}: {bounded_repr(before[key])} -> {bounded_repr(value)}")
    return changes


def log_nothing_to_do(step: int, epochs_finished: int, changes: Optional[List[str]]) -> None:
    """Warn that the resumed run had already finished (call on rank zero)."""
    differ = (
        f"; settings that differ from the run's config.yaml: {', '.join(changes)}"
        if changes
        else "; the settings are the run's own"
    )
    logger.warning(
        "the resumed run finished at step %d (%d epochs); nothing to do%s. To train further, raise epochs or max_steps; "
        "to start anew, choose another output_dir",
        step,
        epochs_finished,
        differ,
    )
