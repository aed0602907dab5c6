"""DefaultCheckpointer: atomic checkpoint files in any fsspec directory, with retention."""

import logging
import re
from typing import Any, Dict, List, Optional

import torch

from framework.checkpoint import storage
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.async_writer import BackgroundWriter
from framework.checkpoint.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


def checkpoint_name(global_step: int) -> str:
    """File name of the checkpoint taken after ``global_step`` optimizer steps."""
    return f"checkpoint-{global_step:09d}.pt"


def copy_to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are fresh CPU tensors (safe to write while training goes on)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: copy_to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(value) for value in obj)
    return obj


class DefaultCheckpointer(AbstractCheckpointer):
    """Writes ``checkpoint-<step>.pt`` files into a local directory or any fsspec URL.

    Every file is written to a temporary name and moved into place, so a crash never
    leaves a partial file under a checkpoint name. Loading takes the newest file that reads
    back; a truncated or corrupt one is reported (path and reason) and skipped. Retention
    keeps the newest ``keep_last_n`` plus the best ``keep_best_n`` by ``metric``.

    Args:
        args: where, when and how many (see :class:`DefaultCheckpointerArguments`).
        default_dir: used when ``args.save_dir`` is None (the trainer passes
            ``<output_dir>/checkpoints``).

    Example:
        >>> checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir="memory://doc", load_dir="memory://doc"))
        >>> checkpointer.save(Checkpoint({"model": {}}, {}, {}, global_step=5), index=1)
        'memory://doc/checkpoint-000000005.pt'
        >>> checkpointer.load().global_step
        5
    """

    def __init__(self, args: Optional[DefaultCheckpointerArguments] = None, default_dir: str = "outputs/checkpoints") -> None:
        self.args = args if args is not None else DefaultCheckpointerArguments()
        self.save_dir = self.args.save_dir or default_dir
        self._fs, self._dir = storage.resolve(self.save_dir)
        self._scores: Dict[str, float] = {}
        self._writer = BackgroundWriter()

    # -- saving ---------------------------------------------------------------------
    def save(self, checkpoint: Checkpoint, index: int, force: bool = False) -> Optional[str]:
        if not force and not (self.args.period and index % self.args.period == 0):
            return None
        name = checkpoint_name(checkpoint.global_step)
        score = checkpoint.metrics.get(self.args.metric)
        if score is not None:
            self._scores[name] = float(score)
        data = checkpoint.to_dict()
        if self.args.async_save:
            data = copy_to_cpu(data)
            self._writer.submit(lambda: self._write(name, data))
        else:
            self._write(name, data)
        return self._url(name)

    def _write(self, name: str, data: Dict[str, Any]) -> None:
        storage.write_atomically(self._fs, storage.join(self._dir, name), data)
        self._apply_retention()

    def save_model(self, state: Dict[str, Any], index: int) -> Optional[str]:
        name = f"model-{index:09d}.pt"
        storage.write_atomically(self._fs, storage.join(self._dir, name), copy_to_cpu(state))
        return self._url(name)

    def is_step_save_due(self, global_step: int) -> bool:
        every = self.args.save_every_n_steps
        return bool(every) and global_step % every == 0

    def wait(self) -> None:
        self._writer.wait()

    def _url(self, name: str) -> str:
        return storage.join(self.save_dir, name)

    # -- retention ------------------------------------------------------------------
    def _checkpoint_files(self, directory: str) -> List[str]:
        """Checkpoint paths in ``directory``, newest (highest step) first."""
        named = []
        for path in storage.list_files(self._fs, directory):
            match = _CHECKPOINT_NAME.match(path.rsplit("/", 1)[-1])
            if match:
                named.append((int(match.group(1)), path))
        return [path for _, path in sorted(named, reverse=True)]

    def _apply_retention(self) -> None:
        if self.args.keep_last_n is None:
            return
        paths = self._checkpoint_files(self._dir)
        keep = set(paths[: self.args.keep_last_n])
        if self.args.keep_best_n:
            scored = [path for path in paths if path.rsplit("/", 1)[-1] in self._scores]
            scored.sort(key=lambda path: self._scores[path.rsplit("/", 1)[-1]], reverse=self.args.mode == "max")
            keep.update(scored[: self.args.keep_best_n])
        for path in paths:
            if path not in keep:
                self._fs.rm(path)
                self._scores.pop(path.rsplit("/", 1)[-1], None)

    def best_checkpoint(self) -> Optional[str]:
        """URL of the best checkpoint by ``metric`` among those this run scored, or None."""
        if not self._scores:
            return None
        pick = min if self.args.mode == "min" else max
        return self._url(pick(self._scores, key=self._scores.__getitem__))

    # -- loading --------------------------------------------------------------------
    def resume_source(self) -> Optional[str]:
        """The file or directory a run resumes from, per ``load_filename``/``load_dir``/``resume``."""
        if self.args.load_filename:
            return self.args.load_filename
        if self.args.load_dir:
            return self.args.load_dir
        if self.args.resume == "auto":
            return self.save_dir
        return None

    def load(self) -> Optional[Checkpoint]:
        source = self.resume_source()
        if source is None:
            return None
        if self.args.load_filename:
            return self.read(source)
        fs, directory = storage.resolve(source)
        for path in self._checkpoint_files(directory):
            try:
                return self.read(fs.unstrip_protocol(path))
            except storage.CheckpointRefused:
                raise
            except Exception as error:
                logger.warning("skipping unreadable checkpoint %s: %s", path, error)
        logger.info("no readable checkpoint in %s: starting fresh", source)
        return None

    def read(self, url: str) -> Checkpoint:
        """Read the checkpoint file at ``url`` (path or fsspec URL)."""
        fs, path = storage.resolve(url)
        if not fs.exists(path):
            raise FileNotFoundError(f"checkpoint file {url!r} does not exist")
        checkpoint = Checkpoint.from_dict(storage.read(fs, path, weights_only=self.args.weights_only))
        logger.info("loaded checkpoint %s (epoch %d, step %d)", url, checkpoint.epoch, checkpoint.global_step)
        return checkpoint

    # -- state ----------------------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        return {"scores": dict(self._scores)}

    def update_state(self, state: Dict[str, Any]) -> None:
        self._scores.update(state.get("scores", {}))
