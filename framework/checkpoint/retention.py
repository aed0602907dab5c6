"""Checkpoint names in a save directory, and which of them a run keeps: the newest
``keep_last_n``, the best ``keep_best_n`` by a metric, and none newer than the one just written.

Retention touches only this run's checkpoints: one that names another run id (a run that
fine-tuned from this directory's checkpoints with ``load_dir``, or wrote here before) is left
as it is, whatever its step (:func:`saved_run_id`; checkpoints written before run ids existed,
and damaged ones, are treated as before).
"""

import logging
import os
import posixpath
import re
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from backends.checkpoint_io import run_files
from framework.checkpoint import storage
from framework.checkpoint.finite import best_first
from framework.run.run_identity import UNREADABLE
from framework.run.run_lock import check_lock_held

logger = logging.getLogger("framework.checkpoint.default")  # the checkpointer's messages keep one logger name

STALE_SUFFIX = ".stale"
"""Checkpoints newer than the one a resumed run writes are renamed ``<name>.stale`` (see ``apply_retention``)."""
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)(\.pt)?$")  # a file, or a directory of shards
_TEMPORARY = r"\.pt\.[0-9a-f]+" + re.escape(storage.TEMPORARY_SUFFIX) + "$"
_CHECKPOINT_TEMPORARY = re.compile(r"^\.checkpoint-\d+" + _TEMPORARY)
ANY_TEMPORARY = re.compile(r"^\.(checkpoint|model)-\d+(" + _TEMPORARY + r"|\.partial$)")
"""Leftovers of a killed save: temporary files; for sharded checkpoints, ``.partial`` directories."""


def step_in_name(path: str) -> Optional[int]:
    """The step a checkpoint's name says it holds (``checkpoint-000000008.pt`` -> 8), or None for another name.

    Example:
        >>> step_in_name("s3://b/run/checkpoint-000000008.pt"), step_in_name("run/checkpoint-000000008/"), step_in_name("w.pt")
        (8, 8, None)
    """
    match = _CHECKPOINT_NAME.match(basename(path.rstrip("/")))
    return int(match.group(1)) if match else None


def check_name_agrees(path: str, global_step: int) -> None:
    """Refuse a checkpoint whose name says another step than it holds (a copy or a link put under a
    newer name would be resumed as the newest and have retention rename the real ones stale).

    Raises:
        CorruptCheckpoint: the step in the name is not ``global_step`` (the resume skips it for an older one).

    Example:
        >>> check_name_agrees("run/checkpoint-000000099.pt", 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CorruptCheckpoint: run/checkpoint-000000099.pt is named for step 99 but holds step 8 ...
    """
    named = step_in_name(path)
    if named is not None and named != global_step:
        raise storage.CorruptCheckpoint(
            f"{path} is named for step {named} but holds step {global_step} (a copy or a link under another name): "
            "it is not resumed from; rename it checkpoint-" + f"{global_step:09d} or move it away"
        )


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


_RUN_IDS: Dict[Tuple[str, Any, Any], Optional[str]] = {}  # run id by (path, mtime, size): each file read once
_RUN_IDS_LOCK = threading.Lock()
_FOREIGN_SEEN: Set[str] = set()  # foreign checkpoints already reported


def _version(fs: Any, target: str) -> Tuple[str, Any, Any]:
    """``(path, mtime, size)``: a file's version, whose run id never changes."""
    if storage._is_local(fs):
        status = os.stat(target, follow_symlinks=False)
        return target, status.st_mtime_ns, status.st_size
    info = fs.info(target)
    return target, info.get("mtime") or info.get("LastModified") or info.get("ETag"), info.get("size")


def _record_file(path: str) -> str:
    return path if basename(path).endswith(".pt") else posixpath.join(path.rstrip("/"), "state.pt")


def remember_run_id(fs: Any, path: str, run_id: Optional[str]) -> None:
    """Note that the checkpoint just written at ``path`` holds ``run_id``: retention then never reads it back."""
    try:
        key = _version(fs, _record_file(path))
    except (OSError, ValueError):
        return
    with _RUN_IDS_LOCK:
        _RUN_IDS[key] = run_id


def saved_run_id(fs: Any, path: str) -> Optional[str]:
    """The run id recorded in the checkpoint at ``path`` (a file, or a directory of shards whose
    ``state.pt`` holds it); None when it records none; :data:`UNREADABLE` when it cannot be read
    (damaged, odd, or holding what ``weights_only`` refuses: whose it is is unknown). Read once per
    file version, and never for a checkpoint this process wrote (:func:`remember_run_id`).

    Example:
        >>> import tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "checkpoint-000000001.pt")
        >>> torch.save({"trainer": {"run_id": "ab" * 16}}, path)
        >>> saved_run_id(storage.resolve(path)[0], path) == "ab" * 16
        True
    """
    target = _record_file(path)
    try:
        key = _version(fs, target)
    except (OSError, ValueError):
        return UNREADABLE
    with _RUN_IDS_LOCK:
        if key in _RUN_IDS:
            return _RUN_IDS[key]
    try:
        data = run_files.load_torch_mapped(fs, target, run_files.CHECKPOINT)  # the tensors are not read
    except Exception:  # damaged, odd, or not loadable without unpickling code: no run id known
        data = UNREADABLE
    state = data.get("trainer") if isinstance(data, dict) else None  # Checkpoint.to_dict()
    found = state.get("run_id") if isinstance(state, dict) else None
    run_id = UNREADABLE if data is UNREADABLE else found if isinstance(found, str) else None
    with _RUN_IDS_LOCK:
        if len(_RUN_IDS) > 4096:
            _RUN_IDS.clear()
        _RUN_IDS[key] = run_id
    return run_id


def apply_retention(
    fs: Any,
    directory: str,
    written_step: int,
    scores: CheckpointScores,
    keep_last_n: Optional[int],
    keep_best_n: int,
    mode: str,
    run_id: Optional[str] = None,
) -> None:
    """Tidy ``directory`` after the checkpoint of ``written_step`` was written (on rank zero).

    Checkpoints with a higher step come from this run's own earlier attempt, later resumed
    from an older checkpoint: they are renamed ``<name>.stale`` (never resumed from again).
    Leftovers of killed saves are removed. With ``keep_last_n`` set, only the newest
    ``keep_last_n`` plus the best ``keep_best_n`` by their ``scores`` stay. Nothing is touched
    when this run's lock on the directory was taken over (:class:`~framework.run.run_lock.RunLockLost`),
    and with ``run_id`` (this run's) no checkpoint that names another run id.
    """
    check_lock_held(directory)
    entries = checkpoint_entries(fs, directory)
    if run_id is not None:
        entries = [(step, path) for step, path in entries if _own(fs, path, run_id)]
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
        tagged = storage.temporary_run_id(basename(path))  # the run that wrote it, when its name says
        if _CHECKPOINT_TEMPORARY.match(basename(path)) and (run_id is None or tagged in (None, run_id)):
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


def _own(fs: Any, path: str, run_id: str) -> bool:
    """False (said once per file) when the checkpoint at ``path`` names another run id than
    ``run_id``, or cannot be read (unknown is not "mine"); True for this run's and for those written
    before run ids existed."""
    saved = saved_run_id(fs, path)
    if saved is None or saved == run_id:
        return True
    if path not in _FOREIGN_SEEN:
        _FOREIGN_SEEN.add(path)
        logger.warning(
            "checkpoint %s belongs to %s, not to this run (%s): retention neither renames nor deletes it",
            fs.unstrip_protocol(path),
            "a run whose id cannot be read" if saved == UNREADABLE else f"run {saved}",
            run_id,
        )
    return False
