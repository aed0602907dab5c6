"""Checkpoint names in a save directory, and which of them a run keeps: the newest
``keep_last_n``, the best ``keep_best_n`` by a metric, and none newer than the one just written."""

import logging
import re
import threading
from typing import Any, Dict, List, Optional, Tuple

from framework.checkpoint import storage
from framework.checkpoint.finite import best_first
from framework.run.run_lock import check_lock_held

logger = logging.getLogger("framework.checkpoint.default")  # the checkpointer's messages keep one logger name

STALE_SUFFIX = ".stale"
"""Checkpoints newer than the one a resumed run writes are renamed ``<name>.stale`` (see ``apply_retention``)."""
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(\.pt)?$")  # a file, or a directory of shards
_TEMPORARY = r"\.pt\.[0-9a-f]+" + re.escape(storage.TEMPORARY_SUFFIX) + "$"
_CHECKPOINT_TEMPORARY = re.compile(r"^\.checkpoint-\d+" + _TEMPORARY)
ANY_TEMPORARY = re.compile(r"^\.(checkpoint|model)-\d+(" + _TEMPORARY + r"|\.partial$)")
"""Leftovers of a killed save: temporary files; for sharded checkpoints, ``.partial`` directories."""


def checkpoint_name(global_step: int, suffix: str = ".pt") -> str:
    """Name of the checkpoint taken after ``global_step`` optimizer steps (``suffix``: the
    strategy's ``checkpoint_suffix``; ``""`` names a directory of shards).

    Example:
        >>> checkpoint_name(5), checkpoint_name(5, suffix="")
        ('checkpoint-000000005.pt', 'checkpoint-000000005')
    """
    return f"checkpoint-{global_step:09d}{suffix}"


def model_name(step: int) -> str:
    """File name of the model-only export taken after ``step`` optimizer steps."""
    return f"model-{step:09d}.pt"


def basename(path: str) -> str:
    """The last part of a path or URL (a directory's trailing slash ignored)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def checkpoint_entries(fs: Any, directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of the checkpoints (files or directories) in ``directory``, newest first."""
    named = []
    for path in storage.list_entries(fs, directory):
        match = _CHECKPOINT_NAME.match(basename(path))
        if match:
            named.append((int(match.group(1)), path))
    return sorted(named, reverse=True)


class CheckpointScores:
    """The monitored metric of each checkpoint a run wrote or resumed, by checkpoint name, for
    best-k retention and ``best_checkpoint``. Thread-safe: the background writer forgets the
    score of a checkpoint whose write failed.

    Example:
        >>> scores = CheckpointScores()
        >>> scores.record("checkpoint-000000002.pt", 0.5); scores.record("checkpoint-000000004.pt", 0.25)
        >>> scores.best("min")
        'checkpoint-000000004.pt'
    """

    def __init__(self) -> None:
        self._scores: Dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, name: str, score: Optional[float]) -> None:
        """Rank checkpoint ``name`` by ``score`` (None: it has no score, it is never best)."""
        with self._lock:
            if score is not None:
                self._scores[name] = float(score)
            else:
                self._scores.pop(name, None)

    def forget(self, name: str) -> None:
        with self._lock:
            self._scores.pop(name, None)

    def best(self, mode: str) -> Optional[str]:
        """The name of the best-scored checkpoint (NaN and inf never are), or None."""
        with self._lock:
            ranked = best_first(self._scores, mode)
        return ranked[0] if ranked else None

    def best_among(self, names: List[str], mode: str, count: int) -> List[str]:
        """The best ``count`` of ``names`` (those without a score are never among them)."""
        with self._lock:
            scores = {name: score for name, score in self._scores.items() if name in names}
        return best_first(scores, mode)[:count]

    def state_dict(self) -> Dict[str, float]:
        with self._lock:
            return dict(self._scores)

    def load_state_dict(self, scores: Dict[str, float]) -> None:
        """Add ``scores`` (saved by :meth:`state_dict`) to the ones known."""
        with self._lock:
            self._scores.update(scores)


def apply_retention(
    fs: Any, directory: str, written_step: int, scores: CheckpointScores, keep_last_n: Optional[int], keep_best_n: int, mode: str
) -> None:
    """Tidy ``directory`` after the checkpoint of ``written_step`` was written (on rank zero).

    Checkpoints with a higher step come from this run's own earlier attempt, later resumed
    from an older checkpoint: they are renamed ``<name>.stale`` (never resumed from again).
    Leftovers of killed saves are removed. With ``keep_last_n`` set, only the newest
    ``keep_last_n`` plus the best ``keep_best_n`` by their ``scores`` stay. Nothing is touched
    when this run's lock on the directory was taken over (:class:`~framework.run.run_lock.RunLockLost`).
    """
    check_lock_held(directory)
    entries = checkpoint_entries(fs, directory)
    for step, path in entries:
        if step > written_step:
            logger.warning(
                "checkpoint %s is newer (step %d) than the one this run just wrote (step %d): it was written before "
                "this run was resumed from an older checkpoint; renamed to %s so it is never resumed from",
                fs.unstrip_protocol(path),
                step,
                written_step,
                basename(path) + STALE_SUFFIX,
            )
            fs.mv(path, path + STALE_SUFFIX, recursive=True)
    paths = [path for step, path in entries if step <= written_step]
    for path in storage.list_files(fs, directory):
        if _CHECKPOINT_TEMPORARY.match(basename(path)):  # left by a process killed while saving
            fs.rm(path)
    if keep_last_n is None:
        return
    keep = set(paths[:keep_last_n])
    if keep_best_n:
        present = {basename(path): path for path in paths}
        keep.update(present[name] for name in scores.best_among(list(present), mode, keep_best_n))
    for path in paths:
        if path not in keep:
            fs.rm(path, recursive=True)
            scores.forget(basename(path))
