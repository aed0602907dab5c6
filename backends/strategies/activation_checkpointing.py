"""Activation checkpointing: each unit's activations are recomputed in backward instead of kept.

Applied to the module's units (``sharding_units()``, see :mod:`backends.strategies.units`) before the
strategy wraps the module, which gives torchtitan's order: checkpoint, then compile, then
shard (FSDP2's hooks stay outside the recomputed forward, so a unit's parameters are
gathered once for its backward and its recomputation together).
"""

import functools
from typing import Any, Callable, List

import torch
from torch.utils.checkpoint import checkpoint

from backends.strategies.units import module_units

_MARK = "_activation_checkpointed"


def _recomputed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation keeps nothing for backward anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """Make each unit of ``module`` recompute its forward in backward (``torch.utils.checkpoint``,
    non-reentrant: RNG states are restored, so dropout draws the same masks); return the units.

    Parameter names, state-dict keys and the module tree stay as they are (the unit's own
    ``forward`` is wrapped in place), so checkpoints and exports are the same with and without
    it. Calling it again leaves units already wrapped as they are. Gradients are those of the
    plain forward; only memory and time change.

    Raises:
        ValueError: the module has no units: ``sharding_units()`` returned none and it holds no
            ``nn.ModuleList`` / ``nn.ModuleDict`` blocks.

    Example:
        >>> net = torch.nn.Module()
        >>> net.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        >>> len(checkpoint_units(net))
        2
    """
    units = module_units(module)
    if not units:
        raise ValueError(
            f"activation_checkpointing=True recomputes each unit of {type(module).__name__} in backward, but it has "
            "none: sharding_units() returned none and it holds no nn.ModuleList or nn.ModuleDict blocks; define "
            "sharding_units() to return the blocks to checkpoint (e.g. the transformer layers), or set "
            "activation_checkpointing=False"
        )
    for unit in units:
        if not getattr(unit, _MARK, False):
            unit.forward = functools.partial(_recomputed_forward, unit.forward)
            setattr(unit, _MARK, True)
    return units
