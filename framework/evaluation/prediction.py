"""Prediction: every sample of the module's predict loader once across ranks, outputs in dataset
order on rank zero, or written to disk part by part when they do not fit in memory."""

import logging
import posixpath
import re
from collections.abc import Mapping
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from backends import TrainerBackend, map_tensors
from backends.data.samplers import ResumableSampler
from framework.checkpoint import storage
from framework.config.arguments import TrainerArguments
from framework.evaluation.weights import on_main_then_everywhere
from framework.loop.stage import Stage
from framework.loop.step_outputs import concatenate_outputs
from framework.metrics.collector import infer_batch_size
from framework.module import ModuleInterface, StepRunner

logger = logging.getLogger("framework")

_PREDICTION_FILE = re.compile(r"^predictions-rank(\d+)-(\d+)\.pt$")


def prediction_file_name(rank: int, part: int) -> str:
    """``predictions-rank<rank>-<part>.pt``: the ``part``-th batch rank ``rank`` predicted."""
    return f"predictions-rank{rank}-{part:05d}.pt"


class Predictor:
    """Runs ``module.predict_step`` on every batch of ``module.get_predict_dataloader``.

    The loader's ``sampler(dataset)`` keeps dataset order and does not pad, so every sample is
    predicted exactly once across ranks. Each step's outputs (a tensor, a tuple, a dict, ...)
    are detached and moved to the CPU as they come. Without ``predictions_dir`` the outputs are
    joined over batches (tensors concatenated along the first dimension, dicts key by key) and
    gathered on rank zero in dataset order; with it, each rank writes every batch's outputs to
    ``predictions-rank<r>-<part>.pt`` (``{"indices": dataset indices, "outputs": ...}``) and keeps
    nothing; :func:`load_predictions` reads such a directory back in dataset order.

    Args:
        module: the user's module.
        backend: the trainer's backend (autocast, device, sampler, collectives).
        args: the run's arguments (seed).
        runner: the step dispatcher the steps go through (the trainer's, which ``fsdp`` shards;
            None: a new one around ``module``).

    Example:
        predictions = Predictor(module, backend, args).run(global_step=0, batch_size=64)
    """

    def __init__(
        self,
        module: ModuleInterface,
        backend: TrainerBackend,
        args: TrainerArguments,
        runner: Optional[torch.nn.Module] = None,
    ) -> None:
        self.module = module
        self.backend = backend
        self.args = args
        self.runner = runner if runner is not None else StepRunner(module)

    def loader(self, batch_size: int) -> Any:
        """The module's predict loader, ready for this rank.

        Raises:
            NotImplementedError: the module has no ``get_predict_dataloader`` (or it returned None).
            ValueError: under several ranks, a map-style loader whose sampler is not ``sampler(dataset)``.
        """
        sampler = self.backend.sampler_factory(shuffle=False, seed=self.args.seed)
        name = type(self.module).__name__
        get_loader = getattr(self.module, "get_predict_dataloader", None)
        loader = get_loader(sampler, batch_size) if callable(get_loader) else None
        if loader is None:
            raise NotImplementedError(
                f"predict() needs {name}.get_predict_dataloader(sampler, batch_size) to return a DataLoader built "
                "with sampler(dataset), e.g. DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset))"
            )
        own_sampler = getattr(loader, "sampler", None)
        is_stream = isinstance(getattr(loader, "dataset", None), IterableDataset)
        if isinstance(own_sampler, ResumableSampler) and own_sampler.shuffle:
            raise ValueError(
                f"{name}.get_predict_dataloader: predictions keep dataset order; use sampler(dataset), not shuffle=True"
            )
        distributed_map_style = self.backend.data_parallel_size > 1 and isinstance(loader, DataLoader) and not is_stream
        if distributed_map_style and not isinstance(own_sampler, ResumableSampler):
            raise ValueError(
                f"{name}.get_predict_dataloader returned a DataLoader with a {type(own_sampler).__name__}: under "
                f"{self.backend.data_parallel_size} data-parallel ranks every rank would predict every sample; build it with "
                "sampler=sampler(dataset)"
            )
        return self.backend.prepare_loader(loader)

    def run(self, global_step: int, batch_size: int, predictions_dir: Optional[str] = None) -> Any:
        """Predict every sample; rank zero returns the outputs in dataset order (or, with
        ``predictions_dir``, the directory), the other ranks None. Collective: call on every rank.

        Raises:
            FileExistsError: ``predictions_dir`` already holds prediction files.
        """
        loader = self.loader(batch_size)
        writer = None if predictions_dir is None else PredictionWriter(predictions_dir, self.backend)
        collected: List[Any] = []
        module, backend, device = self.module, self.backend, self.backend.device
        was_training, previous_logger = module.training, module._metric_logger
        module._metric_logger = None  # self.log in predict_step records nothing
        module.eval()
        indices = _sample_indices(loader, backend.data_parallel_rank, backend.data_parallel_size)
        try:  # through the runner: a sharded module gathers its parameters in its forward
            with torch.no_grad(), backend.inference(self.runner):
                for batch in loader:
                    size = infer_batch_size(batch)
                    batch = backend.move_to_device(batch)
                    outputs = backend.forward(self.runner, Stage.PREDICT, global_step, batch, device)
                    outputs = map_tensors(outputs, lambda tensor: tensor.detach().cpu())
                    batch_indices = torch.tensor([next(indices) for _ in range(size)], dtype=torch.long)
                    if writer is not None:
                        writer.write(batch_indices, outputs)
                    else:
                        collected.append(_positions(outputs))
        finally:
            module.train(was_training)
            module._metric_logger = previous_logger
        if writer is not None:
            backend.barrier()  # every rank's files are in place
            logger.info("predict: wrote %d file(s) on rank 0 to %s", writer.parts, predictions_dir)
            return predictions_dir if backend.is_main_process else None
        gathered = backend.gather_in_dataset_order(concatenate_outputs(collected))
        if not backend.is_main_process or not gathered:
            return None
        return tuple(gathered) if collected and isinstance(collected[0], _Several) else gathered[0]


class PredictionWriter:
    """Writes one rank's predictions, batch by batch, as ``predictions-rank<r>-<part>.pt`` files
    (atomically: a crash never leaves a partial file under that name), in any fsspec directory.

    Rank zero first refuses a directory that already holds prediction files (another run's, or
    a run with another world size would mix with them); every rank learns the answer.

    Example:
        writer = PredictionWriter("outputs/predictions", backend)
        writer.write(torch.tensor([0, 2]), {"logits": logits})
    """

    def __init__(self, directory: str, backend: TrainerBackend) -> None:
        if not isinstance(directory, str) or not directory:
            raise TypeError(f"predictions_dir={directory!r}: allowed: None or a directory path or fsspec URL")
        self.directory = directory
        self.rank = backend.data_parallel_rank  # files are named by share of the data
        self.writes = backend.rank in backend.data_parallel_representatives()  # one rank per share writes
        self.parts = 0
        self._fs, self._path = storage.resolve(directory)
        on_main_then_everywhere(backend, self._check_empty, f"use predictions_dir={directory!r}")

    def _check_empty(self) -> None:
        if not self._fs.isdir(self._path):
            self._fs.makedirs(self._path, exist_ok=True)
            return
        taken = sorted(
            name
            for name in (posixpath.basename(p) for p in self._fs.ls(self._path, detail=False))
            if _PREDICTION_FILE.match(name)
        )
        if taken:
            raise FileExistsError(
                f"predictions_dir {self.directory!r} already holds {len(taken)} prediction file(s) ({taken[0]}, ...); "
                "remove them or choose another directory"
            )

    def write(self, indices: torch.Tensor, outputs: Any) -> None:
        if not self.writes:  # a tensor-parallel peer: its share is written by its representative
            return
        name = prediction_file_name(self.rank, self.parts)
        storage.write_atomically(self._fs, storage.join(self._path, name), {"indices": indices, "outputs": outputs})
        self.parts += 1


def load_predictions(directory: str) -> Any:
    """Every ``predictions-rank*-*.pt`` file in ``directory``, joined in dataset order (the shape
    ``Trainer.predict`` returns without ``predictions_dir``).

    Raises:
        FileNotFoundError: no prediction file there.

    Example:
        trainer.predict(predictions_dir="outputs/predictions")
        logits = load_predictions("outputs/predictions")
    """
    fs, path = storage.resolve(directory)
    names = sorted(posixpath.basename(p) for p in fs.ls(path, detail=False)) if fs.isdir(path) else []
    names = [name for name in names if _PREDICTION_FILE.match(name)]
    if not names:
        raise FileNotFoundError(f"{directory!r} holds no predictions-rank*-*.pt file")
    parts = [storage.read(fs, storage.join(path, name), weights_only=True) for name in names]
    indices, *outputs = concatenate_outputs([(part["indices"], *_positions(part["outputs"])) for part in parts])
    order = torch.argsort(indices)
    reordered = tuple(_reorder(output, order) for output in outputs)
    return reordered if isinstance(parts[0]["outputs"], tuple) else reordered[0]


class _Several(tuple):
    """A step's tuple of outputs: each position is joined over batches on its own."""


def _positions(outputs: Any) -> tuple:
    return _Several(outputs) if isinstance(outputs, tuple) else (outputs,)


def _reorder(value: Any, order: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[order]
    if isinstance(value, Mapping):
        return {key: _reorder(item, order) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_reorder(item, order) for item in value)
    if isinstance(value, list) and len(value) == len(order):
        return [value[i] for i in order.tolist()]
    return value


def _sample_indices(loader: Any, rank: int, world_size: int) -> Iterator[int]:
    """The dataset index of each sample this rank will predict, in order: the framework sampler's
    own indices, else (a stream) every ``world_size``-th position from ``rank``."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return iter(list(sampler))

    def positions() -> Iterator[int]:
        position = rank
        while True:
            yield position
            position += world_size

    return positions()
