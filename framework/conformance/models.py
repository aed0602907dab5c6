"""The base module every conformance cell trains (a few hundred parameters, CPU-fast).

Every module draws its data from a fixed generator, so every rank (and the ``sp`` reference)
builds the same dataset; the framework's sampler then splits it. The model shapes of the zoo
(``framework/conformance/zoo.py``) subclass :class:`KitNet` and change only :meth:`KitNet.body`.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from framework.module import ModuleInterface

FEATURES = 6
WIDTH = 8


def make_data(samples: int, seed: int) -> TensorDataset:
    """``(x, y, index)`` with y a smooth function of x."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.tanh(x[:, :3].sum(1, keepdim=True)) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(samples))


ID_CLASSES = 5
LARGE_ID = 2**24 + 257
"""The first sample id with ``probes``: past 256 (a uint8 or bf16 rounding: 257 -> 256) and past
2^24 (the largest integer fp32 holds exactly), so an integer input cast on the way changes ``id % 5``."""


def with_large_ids(data: TensorDataset) -> TensorDataset:
    """``data`` with a fourth column: int64 ids from :data:`LARGE_ID` on.

    Example:
        >>> with_large_ids(make_data(3, seed=0))[1][3].item() - LARGE_ID
        1
    """
    ids = torch.arange(len(data), dtype=torch.int64) + LARGE_ID
    return TensorDataset(*data.tensors, ids)


class AugmentedData(Dataset):
    """Adds noise drawn the usual way (torch's global generator) in ``__getitem__``."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        x, y, position = self.data[index]
        return x + 0.1 * torch.randn(x.shape), y, position


class SplitStream(IterableDataset):
    """A stream over ``data`` that the framework splits by rank and loader worker."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return (self.data[index] for index in range(len(self.data)))

    def __len__(self) -> int:
        return len(self.data)


class KitNet(ModuleInterface):
    """Two blocks in an ``nn.ModuleList`` (sharding units under FSDP) and a head.

    Args:
        samples: training samples.
        nan_at_step: from this optimizer step on, the loss is NaN.
        inf_at_step: at this optimizer step only, the loss is inf (an overflow).
        loader: ``"sampler"`` (the framework's), ``"workers"`` (augmentation in 2 loader
            workers) or ``"stream"`` (an ``IterableDataset`` read by 2 workers).
        manual: manual optimization with two optimizers (the body clipped, then the head on
            detached features).
        fits: the largest micro-batch whose ``train_step`` "fits in memory" (a larger one
            raises ``torch.OutOfMemoryError``, for ``gpu_batch_size_limit="auto"``).
        optimizers: under automatic optimization, 1 (SGD over everything) or 2 (SGD for the
            body, Adam for the head: a precision must unscale, clip and step each of them).
        probes: inputs chosen to break cancellations: integer ids past 2^24 (each sample's id
            picks a learned offset by ``id % 5``: an id rounded on the way changes the loss), a
            per-step learning-rate schedule, and metrics reduced by ``sum``, ``max`` and ``min``
            in training and validation (21 validation samples: uneven shares over ranks).

    Example:
        >>> net = KitNet(samples=8)
        >>> net(torch.zeros(2, FEATURES)).shape
        torch.Size([2, 1])
    """

    expected_units = 2
    """How many blocks the model has: each should be a sharding (and compile, checkpointing) unit."""
    ranks: Tuple[int, ...] = (1, 2, 4)
    """World sizes on which this shape trains as ``sp`` does (a shape that computes per rank, such
    as batch norm's batch statistics, is compared on 1 rank only)."""
    learning_rate = 0.2
    """SGD's learning rate (momentum 0.9): large, so a fault shows within a few steps."""
    unused_parameters = False
    """Whether some parameters go unused on a rank in some steps (``find_unused_parameters=True``
    is then set where the backend takes it)."""

    def __init__(
        self,
        samples: int = 64,
        nan_at_step: Optional[int] = None,
        loader: str = "sampler",
        manual: bool = False,
        fits: Optional[int] = None,
        optimizers: int = 1,
        probes: bool = False,
        inf_at_step: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.build()
        self.head = torch.nn.Linear(WIDTH, 1)
        self.train_data = make_data(samples, seed=1)
        self.val_data = make_data(21, seed=2)  # odd: ranks get uneven shares and batches
        self.probes = probes
        if probes:  # built last: the other layers start as without probes
            self.offsets = torch.nn.Embedding(ID_CLASSES, 1)
            self.train_data = with_large_ids(self.train_data)
            self.val_data = with_large_ids(self.val_data)
        self.nan_at_step = nan_at_step
        self.inf_at_step = inf_at_step
        self.loader = loader
        self.fits = fits
        if optimizers not in (1, 2):
            raise ValueError(f"optimizers={optimizers!r} is invalid; allowed: 1, 2")
        self.optimizer_count = optimizers
        if manual:
            self.automatic_optimization = False
        self.compute_dtypes: List[str] = []
        self.seen: List[int] = []
        self.val_order: List[int] = []
        self.setup_saw: List[int] = []

    def build(self) -> None:
        """Create the body's submodules (the zoo's shapes override it and :meth:`body`)."""
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(FEATURES, WIDTH), torch.nn.Linear(WIDTH, WIDTH)])

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """Features of width ``WIDTH`` for the head."""
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def invariants(self) -> List[Tuple[str, bool, str]]:
        """What must hold of this shape after training, whatever the backend: (label, holds, figure)."""
        return []

    def setup(self) -> None:
        self.setup_saw = [self.global_rank, self.world_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def tensor_parallel_plan(self) -> Dict[str, Any]:
        """The ``model-parallel`` backends split the first block by columns, the second by rows;
        the head stays whole (a partial plan: clipping covers DTensors and plain tensors)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.0": ColwiseParallel(), "blocks.1": RowwiseParallel()}

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        if self.automatic_optimization and self.optimizer_count == 1:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)
            if self.probes:  # a per-step schedule: a step skipped or counted twice shows in every later rate
                decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
                return [optimizer], [{"scheduler": decay, "interval": "step"}]
            return [optimizer], []
        head = {id(parameter) for parameter in self.head.parameters()}
        body = [parameter for parameter in self.parameters() if id(parameter) not in head]
        return [torch.optim.SGD(body, lr=self.learning_rate, momentum=0.9), torch.optim.Adam(self.head.parameters(), lr=0.01)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        if self.loader == "stream":
            return DataLoader(SplitStream(self.train_data), batch_size=batch_size, num_workers=2)
        if self.loader == "workers":
            data = AugmentedData(self.train_data)
            return DataLoader(data, batch_size=batch_size, sampler=sampler(data), num_workers=2)
        return DataLoader(self.train_data, batch_size=batch_size, sampler=sampler(self.train_data))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.val_data, batch_size=4, sampler=sampler(self.val_data))

    def get_test_dataloaders(self, sampler: Any, batch_size: int) -> DataLoader:
        return self.get_val_dataloaders(sampler, batch_size)

    def get_predict_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return self.get_val_dataloaders(sampler, batch_size)

    def predicted(self, x: torch.Tensor, batch: Any) -> torch.Tensor:
        """The forward, plus each sample's learned offset chosen by its id (with ``probes``)."""
        prediction = self(x)
        if self.probes:
            prediction = prediction + self.offsets(batch[3].long() % ID_CLASSES).to(prediction.dtype)
        return prediction

    def log_probes(self, stage: str, errors: torch.Tensor) -> None:
        """Per-sample ``errors`` logged reduced by sum, max and min (with ``probes``)."""
        if self.probes:
            for reduce in ("sum", "max", "min"):
                self.log(f"{stage}_{reduce}", errors.detach().float(), reduce=reduce, on_step=stage == "train")

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        x, y, index = batch[:3]
        if self.fits is not None and len(x) > self.fits:
            raise torch.OutOfMemoryError(f"a micro-batch of {len(x)} does not fit (at most {self.fits})")
        if not self.automatic_optimization:
            return self._manual_step(x, y)
        prediction = self.predicted(x, batch)
        if len(self.compute_dtypes) < 1:
            self.compute_dtypes.append(str(prediction.dtype).replace("torch.", ""))
        self.seen.extend(index.tolist())
        loss = F.mse_loss(prediction.float(), y)
        self.log_probes("train", (prediction.float() - y).pow(2).mean(1))
        if self.nan_at_step is not None and global_step >= self.nan_at_step:
            loss = loss * float("nan")
        if global_step == self.inf_at_step:  # one overflowing step: a GradScaler skips it and halves its scale
            loss = loss * float("inf")
        return loss

    def _manual_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        body, head = self.optimizers()
        loss = F.mse_loss(self.head(self.body(x)).float(), y)
        self.manual_backward(loss)
        self.clip_gradients(body, max_norm=0.5)
        body.step()
        body.zero_grad()
        head.zero_grad()
        head_loss = F.mse_loss(self.head(self.body(x).detach()).float(), y)
        self.manual_backward(head_loss)
        head.step()
        head.zero_grad()
        return loss.detach()

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        x, y, index = batch[:3]
        errors = (self.predicted(x, batch).float() - y).pow(2).mean(1)
        self.log("val_weighted", errors.mean(), batch_size=len(x))
        self.log_probes("val", errors)
        return errors.mean(), index

    def predict_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        x, index = batch[0], batch[2]
        return {"index": index, "prediction": self(x).float()}

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        self.val_order = outputs[1].tolist()


class KitTwoOptimizers(KitNet):
    """Manual optimization with two optimizers (kept for code that named it; ``KitNet(manual=True)``)."""

    automatic_optimization = False


def flat(state: Dict[str, Any]) -> List[float]:
    """Every tensor of ``state`` (sorted by name) as one list of floats (complex as real pairs)."""
    parts = []
    for name in sorted(state):
        tensor = state[name].detach().cpu()
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        parts.append(tensor.double().reshape(-1))
    return torch.cat(parts).tolist() if parts else []


def full_parameters(trainer: Any) -> List[float]:
    """Every parameter of the trainer's module, whole (gathered from the shards: collective)."""
    named: Dict[str, Any] = dict(trainer.module.named_parameters())
    full = trainer.backend.unsharded(named)
    return torch.cat([tensor.detach().float().reshape(-1).cpu() for tensor in full.values()]).tolist()


def full_state(trainer: Any) -> List[float]:
    """The module's whole ``state_dict`` (parameters and buffers, gathered: collective), flat."""
    return flat(trainer.backend.unsharded(dict(trainer.module.state_dict())))
