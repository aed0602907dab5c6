"""The train data pipelines users build, by name, for ``resume_script.py --pipeline NAME``.

Each takes the toy's ``TensorDataset``, the ``sampler`` callable and the micro-batch size the
trainer hands ``get_train_dataloader``, and returns the loader:

- ``sampler``: ``DataLoader(dataset, sampler=sampler(dataset))`` (the framework's sampler);
- ``stateful-sampler``: torchdata's ``StatefulDataLoader`` with the framework's sampler;
- ``stateful-shuffle``: ``StatefulDataLoader(dataset, shuffle=True)`` (torchdata's own sampler);
- ``workers``: the framework's sampler, 2 worker processes, random augmentation from the
  workers' global generators (``torch.randn`` in ``__getitem__``);
- ``stateful-workers``: the same in a ``StatefulDataLoader``;
- ``stream``: an ``IterableDataset`` with ``state_dict()`` / ``load_state_dict()``;
- ``stream-stateless``: an ``IterableDataset`` without them (cannot resume mid-epoch).
"""

from typing import Any, Callable, Dict, Iterator, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset


class Augmented(Dataset):
    """``x`` plus noise from the global generator (the usual way to write augmentation)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.x, self.y = dataset.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.3 * torch.randn(self.x[index].shape), self.y[index]


class Stream(IterableDataset):
    """The samples in a new order each pass, drawn from the global generator (which checkpoints
    keep), read one by one; nothing says where a pass stands."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.x, self.y = dataset.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for index in torch.randperm(len(self.x)):
            yield self.x[index], self.y[index]


class StatefulStream(Stream):
    """A stream that says where it is (the dataset state protocol): pass ``p`` reads the samples
    in an order seeded by ``p``, ``position`` of them are read."""

    def __init__(self, dataset: TensorDataset) -> None:
        super().__init__(dataset)
        self.passes, self.position = 0, 0

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        if self.position >= len(self.x):  # the last pass was read to its end
            self.passes, self.position = self.passes + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.passes))
        while self.position < len(order):
            index = order[self.position]
            self.position += 1
            yield self.x[index], self.y[index]

    def state_dict(self) -> Dict[str, int]:
        return {"passes": self.passes, "position": self.position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.passes, self.position = state["passes"], state["position"]


def _stateful_loader(*args: Any, **kwargs: Any) -> DataLoader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(*args, **kwargs)


PIPELINES: Dict[str, Callable[[TensorDataset, Callable, int], Any]] = {
    "sampler": lambda data, sampler, batch: DataLoader(data, batch_size=batch, sampler=sampler(data)),
    "stateful-sampler": lambda data, sampler, batch: _stateful_loader(data, batch_size=batch, sampler=sampler(data)),
    "stateful-shuffle": lambda data, sampler, batch: _stateful_loader(data, batch_size=batch, shuffle=True),
    "workers": lambda data, sampler, batch: DataLoader(Augmented(data), batch_size=batch, sampler=sampler(data), num_workers=2),
    "stateful-workers": lambda data, sampler, batch: _stateful_loader(
        Augmented(data), batch_size=batch, sampler=sampler(data), num_workers=2
    ),
    "stream": lambda data, sampler, batch: DataLoader(StatefulStream(data), batch_size=batch),
    "stream-stateless": lambda data, sampler, batch: DataLoader(Stream(data), batch_size=batch),
}


def train_loader(name: str, dataset: TensorDataset, sampler: Callable, batch_size: int) -> Any:
    """The pipeline ``name`` over ``dataset``."""
    if name not in PIPELINES:
        raise ValueError(f"pipeline {name!r} is unknown; allowed: {sorted(PIPELINES)}")
    return PIPELINES[name](dataset, sampler, batch_size)
