"""The mesh a backend runs the kit's cells in at each world size: at 4 ranks, the layouts with two
dimensions above 1 that 2 ranks cannot reach.

At 1 and 2 ranks every backend runs as it is built (its own defaults: ``fsdp`` shards over every
rank, ``model-parallel`` is a 1x2 mesh: all tensor-parallel). At 4 ranks the kit gives each backend
the 2x2 layout its options allow, read from the options the strategy takes
(``TrainerBackend.options``, the same names ``TrainerArguments`` has):

- a strategy that takes ``tensor_parallel_size`` (``model-parallel``): ``tensor_parallel_size=2``,
  a 2x2 ``("dp", "tp")`` mesh: 2 data-parallel rows of 2 tensor-parallel peers;
- else one that takes ``data_parallel_replicate_size`` (``fsdp``, ``fsdp-amp``, ``fsdp-bf16``):
  HSDP 2x2, 2 replica groups each sharding over 2 ranks;
- else (``ddp``): 4 data-parallel ranks.

Every layout reads 4 (or 2, under ``model-parallel``) data-parallel shares, so the reference is
still ``sp`` on the whole batch. A backend that wants another layout at some world size declares
it (``TrainerBackend.conformance_layouts = {4: {"tensor_parallel_size": 4}}``): the pipeline rows
(``fsdp-pp``, :mod:`framework.conformance.pipeline_rows`) declare ``pipeline_parallel_size=2`` at 2 and 4 ranks.
"""

from typing import Any, Dict

from backends import build_backend

LAYOUT_SIZES = (1, 2, 4)
"""World sizes at which the kit runs cells (``--ranks`` refuses any other)."""
TWO_BY_TWO: Dict[str, Dict[str, Any]] = {
    "tensor_parallel_size": {"tensor_parallel_size": 2},
    "data_parallel_replicate_size": {"data_parallel_replicate_size": 2},
}
"""At 4 ranks: the option a strategy takes (checked in this order) and the 2x2 layout it gives."""


def layout_options(backend: str, world_size: int) -> Dict[str, Any]:
    """The ``TrainerArguments`` a cell of ``backend`` runs with at ``world_size`` ranks: the
    backend's declared layout there (``conformance_layouts``), else the 2x2 layout its options
    allow at 4 ranks, else none (the backend's own defaults).

    Example:
        >>> layout_options("fsdp", 4), layout_options("model-parallel", 4)
        ({'data_parallel_replicate_size': 2}, {'tensor_parallel_size': 2})
        >>> layout_options("ddp", 4), layout_options("fsdp", 2)
        ({}, {})
    """
    instance = build_backend(backend)
    declared = getattr(instance, "conformance_layouts", None) or {}
    if world_size in declared:
        return dict(declared[world_size])
    if world_size != 4:
        return {}
    takes = instance.options
    for option, layout in TWO_BY_TWO.items():
        if option in takes:
            return dict(layout)
    return {}


def describe_layout(backend: str, world_size: int) -> str:
    """A few words for the table: ``"HSDP 2x2"``, ``"dp 2 x tp 2"`` or ``""`` (the backend's defaults).

    Example:
        >>> describe_layout("fsdp", 4), describe_layout("model-parallel", 4), describe_layout("ddp", 4)
        ('HSDP 2x2', 'dp 2 x tp 2', '')
        >>> import framework.conformance  # registers the pipeline rows
        >>> describe_layout("fsdp-pp", 2), describe_layout("fsdp-pp", 4)
        ('pp 2', 'pp 2 x dp 2')
    """
    options = layout_options(backend, world_size)
    stages = int(options.get("pipeline_parallel_size", 1) or 1)
    if stages > 1:  # a pipeline row (framework/conformance/pipeline_rows.py): pp outermost
        rest = world_size // stages
        return f"pp {stages}" + (f" x dp {rest}" if rest > 1 else "")
    if "tensor_parallel_size" in options:
        tp = options["tensor_parallel_size"]
        return f"dp {world_size // tp} x tp {tp}"
    if "data_parallel_replicate_size" in options:
        replicas = options["data_parallel_replicate_size"]
        return f"HSDP {replicas}x{world_size // replicas}"
    return ""
