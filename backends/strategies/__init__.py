"""Strategies: where steps run (device, process group, module wrapper, collectives).

One module per strategy: :class:`Strategy` and :class:`SingleProcess` (``strategy.py``),
:class:`DDP`, :class:`FSDP`, :class:`ModelParallel`, and the pieces they share (``units``,
``activation_checkpointing``, ``gradient_clipping``, ``buffers``, ``meta_init``).

Example:
    >>> from backends.strategies import SingleProcess
    >>> SingleProcess().world_size
    1
"""

from backends.strategies.ddp import DDP
from backends.strategies.fsdp import FSDP
from backends.strategies.model_parallel import ModelParallel
from backends.strategies.strategy import SingleProcess, Strategy, select_device

__all__ = ["DDP", "FSDP", "ModelParallel", "SingleProcess", "Strategy", "select_device"]
