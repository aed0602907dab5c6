"""Keep each parameter's gradient-accumulator node alive for the run, as DDP does.

Autograd gives a leaf tensor that takes part in a forward an ``AccumulateGrad`` node and
holds it only weakly: the node lives as long as a graph uses it. When the step's graph is
freed after backward, the nodes go with it and the next forward builds them again, and
building and freeing one takes the GIL (twice) to adjust the parameter's Python reference.
A hand-written loop keeps them by accident (its ``loss`` variable holds the last graph
until the next forward has built its own); ``DistributedDataParallel`` keeps them on
purpose. Counted on the tiny MLP of ``benchmarks/overhead.py``: about 39,000 fewer CPU
instructions per step (``benchmarks/step_cost.py --instructions``), with nothing kept
but the nodes themselves (never a graph or an activation).
"""

from typing import Any, Iterable, List

import torch


def gradient_accumulators(parameters: Iterable[torch.Tensor]) -> List[Any]:
    """The ``AccumulateGrad`` nodes of the plain trainable ``parameters``; holding the list
    keeps them from being rebuilt every step. Tensor subclasses (DTensor shards, whose
    gradients a sharded strategy assigns itself) are left out.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> [type(node).__name__ for node in gradient_accumulators(layer.parameters())]
        ['AccumulateGrad', 'AccumulateGrad']
    """
    kept = []
    with torch.enable_grad():
        for parameter in parameters:
            if type(parameter) is not torch.nn.Parameter or not parameter.requires_grad:
                continue
            view = parameter.view_as(parameter).grad_fn  # ViewBackward0: its input is the accumulator
            if view is not None:
                kept.append(view.next_functions[0][0])
    return kept
