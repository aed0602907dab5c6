"""DataModule: a run's data apart from its model, as Lightning's ``LightningDataModule``.

Given to the trainer (``Trainer(module, args, datamodule=data)``, or named by the config's ``data:``
section: ``framework/config/class_path.py``), it serves the loaders the module does not define itself:
``prepare_data()`` runs once, on rank zero, before any rank reads; ``setup(stage)`` runs on every
rank before the first loader of a stage; samplers and batch sizes still come from the framework, so
its loader methods take ``sampler`` and ``batch_size`` as the module's ``get_*_dataloader`` methods do.
"""

from typing import Any, Dict, Optional, Set

STAGE_OF = {
    "train_dataloader": "fit",
    "val_dataloader": "validate",
    "test_dataloader": "test",
    "predict_dataloader": "predict",
}
"""The ``setup(stage)`` each loader method needs first (``"fit"`` also covers validation, as in Lightning)."""


class DataModule:
    """The data of a run, apart from the model (Lightning's ``LightningDataModule``).

    Override what you need: ``prepare_data()`` (once, on rank zero: downloads, tokenizing to
    disk; nothing to keep on ``self``, the other ranks do not run it), ``setup(stage)`` (on every
    rank, once per stage, before the first loader of ``"fit"``, ``"validate"``, ``"test"`` or
    ``"predict"``: build the datasets there), and the loaders. Each loader method gets the
    framework's ``sampler`` (call ``sampler(dataset)``: it shuffles, shards over ranks and resumes)
    and ``batch_size`` (the micro-batch per process), as the module's own methods do; a module
    that defines ``get_train_dataloader`` (or another) keeps its own. ``state_dict()`` /
    ``load_state_dict()`` travel in checkpoints with the module's state.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Numbers(DataModule):
        ...     def setup(self, stage):
        ...         self.train = TensorDataset(torch.arange(8.0))
        ...     def train_dataloader(self, sampler, batch_size):
        ...         return DataLoader(self.train, batch_size=batch_size, sampler=sampler(self.train))
        >>> data = Numbers()
        >>> loader = data_module_loader(data, "train_dataloader", lambda dataset: range(len(dataset)), 4)
        >>> [batch[0].tolist() for batch in loader], data.stages_set_up
        ([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]], {'fit'})
    """

    def __init__(self) -> None:
        self.stages_set_up: Set[str] = set()
        """The stages whose ``setup`` ran on this rank."""

    def prepare_data(self) -> None:
        """Once, on rank zero, before any rank reads the data (Lightning's ``prepare_data``)."""

    def setup(self, stage: str) -> None:
        """On every rank, before the first loader of ``stage``: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"``."""

    def train_dataloader(self, sampler: Any, batch_size: int) -> Any:
        """The training loader, built with ``sampler(dataset)``."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no train_dataloader(sampler, batch_size), and the module no get_train_dataloader"
        )

    def val_dataloader(self, sampler: Any, batch_size: int) -> Any:
        """One loader, a dict ``{name: loader}``, or None for no validation."""
        return None

    def test_dataloader(self, sampler: Any, batch_size: int) -> Any:
        """Like :meth:`val_dataloader`, for ``Trainer.test``."""
        return None

    def predict_dataloader(self, sampler: Any, batch_size: int) -> Any:
        """The loader ``Trainer.predict`` runs (dataset order), or None."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the data (e.g. a curriculum's position); ``{}`` by default."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def data_module_loader(data: DataModule, method: str, sampler: Any, batch_size: int) -> Any:
    """``data.<method>(sampler, batch_size)`` after ``data.setup(stage)`` for its stage, once per stage
    (validation needs no ``"validate"`` setup after ``"fit"``)."""
    stage = STAGE_OF[method]
    done = getattr(data, "stages_set_up", None)
    if done is None:  # a subclass whose __init__ did not call super().__init__()
        done = data.__dict__.setdefault("stages_set_up", set())
    if stage not in done and not (stage == "validate" and "fit" in done):
        data.setup(stage)
        done.add(stage)
    return getattr(data, method)(sampler, batch_size)


def attach_data_module(module: Any, data: Optional[DataModule], backend: Any) -> None:
    """Give ``module`` its data module and run ``prepare_data()`` on rank zero (every rank waits for it).

    Raises:
        TypeError: ``data`` is not a :class:`DataModule`, naming what it is.
    """
    if data is None:
        return
    if not isinstance(data, DataModule):
        raise TypeError(
            f"datamodule={type(data).__name__} is invalid; allowed: a framework.DataModule (Lightning's "
            "LightningDataModule: subclass framework.DataModule, its loaders take (sampler, batch_size)) or None"
        )
    module.__dict__["datamodule"] = data  # not a submodule: its state goes through get_state()
    backend.run_on_rank_zero(data.prepare_data, "failed in the data module's prepare_data()")
