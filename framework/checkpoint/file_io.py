"""FileIO: the checkpointer's CheckpointIO (atomic fsspec writes, checked and safe reads)."""

from typing import IO, Any, Callable, Optional

import torch

from backends.checkpoint_io import CheckpointIO
from framework.checkpoint import storage


class FileIO(CheckpointIO):
    """Writes checkpoint files atomically (:func:`storage.write_atomically`) and reads them after
    checking their CRCs, with ``weights_only`` loading (:func:`storage.read`).

    Args:
        serialize: writes an object to an open binary handle (the checkpointer's ``serialize``).
        weights_only: refuse pickled objects when reading (sharded indexes: only DCP's index classes).
        stage: copies a state for a background write (default: fresh CPU copies).

    Example:
        >>> io = FileIO()
        >>> io.write("memory://doc-file-io/state.pt", {"w": torch.zeros(2)})
        >>> io.read("memory://doc-file-io/state.pt")["w"]
        tensor([0., 0.])
    """

    def __init__(
        self,
        serialize: Callable[[Any, IO[bytes]], None] = torch.save,
        weights_only: bool = True,
        stage: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self._serialize = serialize
        self.weights_only = weights_only
        self._stage = stage

    def write(self, path: str, obj: Any) -> None:
        fs, inner = storage.resolve(path)
        storage.write_atomically(fs, inner, obj, serializer=self._serialize)

    def read(self, path: str) -> Any:
        fs, inner = storage.resolve(path)
        try:
            return storage.read(fs, inner, weights_only=self.weights_only)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"checkpoint file {path!r} does not exist") from error

    def stage(self, obj: Any) -> Any:
        return super().stage(obj) if self._stage is None else self._stage(obj)
