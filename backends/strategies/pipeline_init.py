"""A meta-built model cut into pipeline stages gets the values one process would draw for it.

:func:`~backends.strategies.meta_init.materialize` draws each meta-built layer's values with its
``reset_parameters()`` in ``module.modules()`` order from the run's seed: on a stage that order lacks
the other stages' layers, so stage 1 would start from other values than ``sp``. Here the whole
model's order is recorded before the cut (:func:`meta_built`); after sharding, each layer in that
order is drawn: this stage's into its (sharded) tensors, another stage's on its own, whole, one layer
at a time, and dropped (the draws advance the generator as they would in one process). A module
with ``init_weights()`` is initialized by it on the stage (torchtitan's way: it sees the parts the
stage holds), as without a pipeline.

Example:
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> order = meta_built(model)
    >>> del model[0]
    >>> materialize_stage(model, torch.device("cpu"), order)
    >>> _ = torch.manual_seed(torch.initial_seed())
    >>> whole = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # what one process draws
    >>> torch.equal(model[0].weight, whole[1].weight)  # the second layer, now the stage's first
    True
"""

from typing import List

import torch

from backends.strategies.meta_init import _is_meta, _tensors, _whole_tensors, materialize


def meta_built(module: torch.nn.Module) -> List[torch.nn.Module]:
    """``module``'s submodules that hold meta tensors of their own, in ``modules()`` order (call before the cut)."""
    return [sub for sub in module.modules() if any(_is_meta(tensor) for tensor in _tensors(sub))]


def materialize_stage(module: torch.nn.Module, device: torch.device, order: List[torch.nn.Module]) -> None:
    """Allocate and initialize the meta tensors of ``module`` (one stage) as the whole model's ``order`` draws them.

    Raises:
        ValueError: as :func:`~backends.strategies.meta_init.materialize` (a layer without ``reset_parameters()``).
    """
    if not order or callable(getattr(module, "init_weights", None)):
        materialize(module, device)
        return
    held = {id(sub) for sub in module.modules()}
    missing = [type(sub).__name__ for sub in order if not callable(getattr(sub, "reset_parameters", None))]
    if missing:
        materialize(module, device)  # refuses, naming them
        return
    for sub in order:
        if id(sub) in held:
            sub.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(torch.initial_seed())
        for sub in order:
            if id(sub) in held:
                with _whole_tensors(sub, device):
                    sub.reset_parameters()  # type: ignore[operator]
            else:  # another stage's layer: drawn whole, then its memory given back
                sub.to_empty(device=device, recurse=False)
                sub.reset_parameters()  # type: ignore[operator]
                sub.to_empty(device=torch.device("meta"), recurse=False)
