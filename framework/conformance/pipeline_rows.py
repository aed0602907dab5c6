"""Pipeline rows of the matrix: ``fsdp`` and ``fsdp-amp`` with ``pipeline_parallel_size=2`` (pp 2 at 2 ranks,
pp 2 x dp 2 at 4), run on a shape that defines ``pipeline_inputs`` / ``pipeline_loss`` and compared with ``sp``
(with the same precision) on the same module.

A row is the built-in backend under a name of its own (``fsdp-pp``), registered here with the
layout it declares (``conformance_layouts``: the kit's way of running a backend in another mesh) and
the features a schedule cannot run declared unsupported (``manual``, ``auto_micro_batch``: each row must
refuse them before step 1). The ``pipeline`` shape (:class:`Pipelined`) targets the rows' cells, so
``python -m framework.conformance fsdp-pp --ranks 2`` runs them::

    python -m framework.conformance fsdp-pp --ranks 2      # pp 2
    python -m framework.conformance fsdp-pp --ranks 4      # pp 2 x dp 2 (slow tier)

On 1 rank a row has no pipeline (the layout needs 2 ranks): it is ``fsdp`` itself.
"""

from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from backends import TrainerBackend, register_backend
from backends.registry import _registry
from framework.conformance.models import FEATURES, WIDTH, KitNet, make_data
from framework.conformance.registry import register_model

PIPELINE_LAYOUTS: Dict[int, Dict[str, Any]] = {2: {"pipeline_parallel_size": 2}, 4: {"pipeline_parallel_size": 2}}
"""Each row's layout by world size: 2 stages (at 4 ranks each stage shards over its 2 data-parallel ranks)."""
PIPELINE_ROWS: Dict[str, str] = {"fsdp-pp": "fsdp", "fsdp-amp-pp": "fsdp-amp"}
"""Row name -> the built-in backend it runs with a pipeline."""
ROW_PATTERN = "*-pp"
"""The ``fnmatch`` pattern of the rows' names (the shape's targets)."""
REFUSED = {
    "manual": "a pipeline schedule runs every backward itself: manual optimization is refused before step 1",
    "auto_micro_batch": 'gpu_batch_size_limit="auto" probes one stage alone: refused before step 1',
}
"""What a pipeline cannot train, declared: the row must refuse it before step 1 (the kit checks)."""
CELLS = ("automatic", "accumulation", "clipping", "resume_kill9", *REFUSED)
"""The features the ``pipeline`` shape runs on the rows."""


class PipelineRow(TrainerBackend):
    """A built-in backend run by the kit with a pipeline layout (:data:`PIPELINE_LAYOUTS`).

    Example:
        >>> from backends import build_backend
        >>> row = build_backend("fsdp-pp")
        >>> row.conformance_layouts[2], sorted(row.declared_unsupported_features)
        ({'pipeline_parallel_size': 2}, ['auto_micro_batch', 'manual'])
    """

    unsupported_features = REFUSED
    conformance_layouts = PIPELINE_LAYOUTS
    conformance_shapes = ("pipeline",)
    """The shapes the kit trains on a row: the others define no ``pipeline_inputs``/``pipeline_loss``."""


def pipeline_row(strategy_backend: Any) -> TrainerBackend:
    """``strategy_backend`` (a built backend) as a :class:`PipelineRow`: same strategy, same precision."""
    return PipelineRow(strategy_backend.strategy, strategy_backend.precision)


def _row_factory(base: str) -> Any:
    def build(args: Any = None) -> TrainerBackend:
        return pipeline_row(_registry[base](args))

    build.__doc__ = f"``{base}`` with the kit's pipeline layout."
    return build


for _row, _base in PIPELINE_ROWS.items():
    register_backend(_row, _row_factory(_base), override=True)


@register_model("pipeline", targets=tuple((feature, ROW_PATTERN) for feature in CELLS), covered=False)
class Pipelined(KitNet):
    """An input layer, 4 blocks in an ``nn.ModuleDict`` and the head (torchtitan's layout in miniature):
    ``pipeline_inputs`` / ``pipeline_loss`` for a pipeline, ``train_step`` (the same loss) everywhere else.
    Under 2 stages the first holds ``embed`` and blocks 0-1, the last blocks 2-3 and ``head``; ``forward``
    runs the parts a stage holds. Every stage records the samples it read and the dtype it computes in."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        # 20 validation samples (5 batches of 4): every share of a split over 2 ranks, right or wrong, reads as many
        # batches of the same shapes, so a fault in the split shows in the values, not as a hang
        self.val_data = make_data(20, seed=2)

    def build(self) -> None:
        self.embed = torch.nn.Linear(FEATURES, WIDTH)
        self.blocks = torch.nn.ModuleDict({str(index): torch.nn.Linear(WIDTH, WIDTH) for index in range(4)})  # type: ignore[assignment]

    @property
    def expected_units(self) -> int:  # type: ignore[override]
        """Every block this module (or stage) holds is a unit."""
        return len(self.blocks)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x)) if self.embed is not None else x
        for block in self.blocks.values():  # type: ignore[operator]
            h = torch.tanh(block(h))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if not self.compute_dtypes:
            self.compute_dtypes.append(str(h.dtype).replace("torch.", ""))
        return self.head(h) if self.head is not None else h

    def pipeline_inputs(self, batch: Any) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        x, y, index = batch[:3]
        if self.training:
            self.seen.extend(index.tolist())
        return (x,), y

    def pipeline_loss(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(prediction.float(), target)

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        inputs, target = self.pipeline_inputs(batch)
        return self.pipeline_loss(self(*inputs), target)

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        """The loss a pipeline evaluates (``val_loss``): ``pipeline_loss`` of the forward."""
        inputs, target = self.pipeline_inputs(batch)
        return self.pipeline_loss(self(*inputs), target)

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        """Nothing kept: a pipeline's evaluation returns its loss only."""

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        """One SGD, or (``optimizers=2``, manual) SGD for the weights and Adam for the biases: every stage holds both."""
        if self.automatic_optimization and self.optimizer_count == 1:
            return super().get_optimizers_schedulers(estimated_global_steps_per_epoch, epochs)
        weights = [parameter for name, parameter in self.named_parameters() if name.endswith("weight")]
        biases = [parameter for name, parameter in self.named_parameters() if not name.endswith("weight")]
        return [torch.optim.SGD(weights, lr=0.2, momentum=0.9), torch.optim.Adam(biases, lr=0.01)], []

    def invariants(self) -> List[Tuple[str, bool, str]]:
        held = len(list(self.parameters()))
        return [("holds parameters", held > 0, f"{held} parameter tensor(s) on this stage")]
