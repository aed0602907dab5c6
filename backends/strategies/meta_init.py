"""Models built on the meta device: each rank allocates only its shard, then initializes it.

A module may build its layers without memory, under ``torch.device("meta")`` in ``__init__``
or in a ``configure_model()`` hook (Lightning's name; the sharding strategies call it under
the meta device, the others as it is). The strategy shards the meta module first, then
:func:`materialize` allocates what each rank holds and initializes it, deterministically
from the run's seed (``torch.initial_seed()``, which ``TrainerArguments.seed`` sets):

- the module's ``init_weights()`` when it defines one (torchtitan's convention), called once
  on the whole module; under ``fsdp`` and ``model-parallel`` it runs on the shards (DTensors), so its random draws
  follow DTensor's random-number rules (the same on every rank, not the values one process draws);
- otherwise each meta-built submodule's ``reset_parameters()``, in ``module.modules()`` order,
  each on the whole tensors of that one submodule (one layer in memory at a time), from
  which each rank keeps its shard: the values one process draws for a module built normally
  in that order, on every backend and world size. Layers built normally keep their values.

Buffers that no ``reset_parameters()`` or ``init_weights()`` writes have no value; a
meta-built submodule that holds parameters or buffers without either is refused, by name.
"""

import contextlib
from typing import Iterator, List

import torch


def has_meta_tensors(module: torch.nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` is on the meta device.

    Example:
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(2, 2)
        >>> has_meta_tensors(layer), has_meta_tensors(torch.nn.Linear(2, 2))
        (True, False)
    """
    return any(_is_meta(tensor) for tensor in _tensors(module, recurse=True))


def move_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)``, leaving tensors on the meta device where they are (the strategy
    allocates them, sharded, later); returns ``module``.

    Example:
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(2, 2)
        >>> move_module(layer, torch.device("cpu")).weight.is_meta
        True
    """
    if not has_meta_tensors(module):
        return module.to(device)
    return module._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(device))


def configure_model(module: torch.nn.Module, on_meta: bool) -> None:
    """Call the module's ``configure_model()`` hook once (under the meta device when ``on_meta``);
    nothing when it has none."""
    hook = getattr(module, "configure_model", None)
    if not callable(hook) or getattr(module, "_framework_model_configured", False):
        return
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        hook()
    module.__dict__["_framework_model_configured"] = True  # once: a second wrap (another trainer) builds nothing


def materialize(module: torch.nn.Module, device: torch.device) -> List[str]:
    """Allocate every meta tensor of ``module`` on ``device`` (each rank its shard, once sharded)
    and initialize it (see the module docstring); returns the names of the submodules initialized.

    Raises:
        ValueError: a meta-built submodule holds tensors but has no ``reset_parameters()`` and
            the module defines no ``init_weights()``: its values would be whatever the memory held.

    Example:
        >>> with torch.device("meta"):
        ...     layer = torch.nn.Linear(2, 2)
        >>> materialize(layer, torch.device("cpu")), layer.weight.device
        ([''], device(type='cpu'))
    """
    built = [(name, sub) for name, sub in module.named_modules() if any(_is_meta(t) for t in _tensors(sub))]
    if not built:
        return []
    init_weights = getattr(module, "init_weights", None)
    if not callable(init_weights):
        missing = [name or type(sub).__name__ for name, sub in built if not callable(getattr(sub, "reset_parameters", None))]
        if missing:
            raise ValueError(
                f"{type(module).__name__} was built on the meta device, but {missing} have no reset_parameters() to "
                "give their parameters and buffers values; define init_weights() on the module (called once after "
                "each rank's shard is allocated, as torchtitan does), or build these layers normally"
            )
    for _, sub in built:  # a layer with any tensor on the meta device is initialized whole
        sub.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(torch.initial_seed())
        if callable(init_weights):
            init_weights()
            return [name for name, _ in built]
        for _, sub in built:
            with _whole_tensors(sub, device):
                sub.reset_parameters()
    return [name for name, _ in built]


@contextlib.contextmanager
def _whole_tensors(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Inside: ``module``'s own sharded parameters and buffers (DTensors) replaced by whole
    tensors; after: each rank's part of what was written into them copied into its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    swapped = {}
    for kind in ("_parameters", "_buffers"):
        for name, tensor in getattr(module, kind).items():
            if isinstance(tensor, DTensor):
                whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                swapped[(kind, name)] = tensor
                getattr(module, kind)[name] = torch.nn.Parameter(whole, tensor.requires_grad) if kind == "_parameters" else whole
    try:
        yield
    finally:
        for (kind, name), sharded in swapped.items():
            whole = getattr(module, kind)[name]
            part = distribute_tensor(whole.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None)
            sharded.to_local().copy_(part.to_local())
            getattr(module, kind)[name] = sharded


def _tensors(module: torch.nn.Module, recurse: bool = False) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def _is_meta(tensor: torch.Tensor) -> bool:
    return _local(tensor).device.type == "meta"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
