"""Which submodules are sharded (FSDP) and compiled (``torch.compile``) as one unit each."""

import logging
import time
from typing import Dict, List, Optional

import torch

logger = logging.getLogger(__name__)


def default_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """Every block that holds parameters of every ``nn.ModuleList`` and ``nn.ModuleDict`` inside
    ``module`` (a transformer's layers, kept in a list or, as torchtitan keeps them, in a dict),
    outermost first. Blocks without parameters (activations, a ``ModuleDict`` of metrics) are not units.

    Lists and dicts inside a unit give no units of their own: a block's experts (a mixture of
    experts keeps them in an ``nn.ModuleDict``) are sharded with the block. A rank whose router
    sends no sample to an expert then still runs the block's one all-gather and reduce-scatter
    (the unused expert's gradient reduced as zeros), where a unit of its own would have skipped
    the collectives the other ranks run, and the ranks would hang.

    Example:
        >>> net = torch.nn.Module()
        >>> net.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        >>> net.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "act": torch.nn.ReLU()})
        >>> net.head = torch.nn.Linear(2, 1)
        >>> len(default_units(net))
        3
    """
    units: List[torch.nn.Module] = []
    inside: set = set()  # ids of every module inside a unit already chosen
    for submodule in module.modules():
        if id(submodule) in inside or not isinstance(submodule, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        blocks = submodule.values() if isinstance(submodule, torch.nn.ModuleDict) else submodule
        for block in blocks:
            if _holds_parameters(block) and id(block) not in inside:
                units.append(block)
                inside.update(id(inner) for inner in block.modules())
    return units


def _holds_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def module_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The module's own choice (``sharding_units()``, see ``ModuleInterface``) or :func:`default_units`.

    Raises:
        TypeError: ``sharding_units()`` returned something else than a list of submodules of ``module``.
    """
    chooser = getattr(module, "sharding_units", None)
    units = chooser() if callable(chooser) else None
    if units is None:
        return default_units(module)
    owned = {id(submodule) for submodule in module.modules() if submodule is not module}
    units = list(units)
    for unit in units:
        if not isinstance(unit, torch.nn.Module) or id(unit) not in owned:
            raise TypeError(
                f"{type(module).__name__}.sharding_units() must return submodules of the module (not the module "
                f"itself); got {type(unit).__name__}"
            )
    return units


def shard_groups(units: List[torch.nn.Module]) -> List[List[torch.nn.Module]]:
    """``units`` grouped so that units sharing a parameter (tied weights, as ALBERT ties its
    layers) are sharded together (FSDP2 keeps a parameter in one group), in the order to shard
    them: inner units before the units that contain them.

    Example:
        >>> first, second, third = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> third.weight = first.weight
        >>> [[unit is first, unit is third] for unit in shard_groups([first, second, third])[1]]
        [[True, False], [False, True]]
    """
    owner: Dict[int, int] = {}  # parameter id -> index of the first unit found holding it
    parent = list(range(len(units)))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    for index, unit in enumerate(units):
        nested = {id(p) for other in units if other is not unit and _contains(unit, other) for p in other.parameters()}
        for parameter in unit.parameters():
            if id(parameter) in nested:
                continue  # sharded with the inner unit
            first = owner.setdefault(id(parameter), index)
            parent[root(index)] = root(first)
    groups: Dict[int, List[int]] = {}
    for index in range(len(units)):
        groups.setdefault(root(index), []).append(index)
    ordered = sorted(groups.values(), key=min, reverse=True)  # a group shards where its outermost unit would
    return [[units[index] for index in members] for members in ordered]


def units_tied_to_root(module: torch.nn.Module, units: List[torch.nn.Module]) -> Dict[str, str]:
    """The units (by name in ``module``) that share a parameter with ``module``'s root, the part of
    it inside no unit (a block's weight tied to the embedding), each with the tied parameter's
    root name. FSDP2 keeps a parameter in one group, so such a unit cannot be sharded on its
    own: it is sharded with the root (its parameters gathered with the root's), and so is any
    unit tied to it in turn.

    Example:
        >>> net = torch.nn.Module()
        >>> net.embed = torch.nn.Linear(2, 2)
        >>> net.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        >>> net.blocks[1].weight = net.embed.weight
        >>> units_tied_to_root(net, list(net.blocks))
        {'blocks.1': 'embed.weight'}
    """
    names = {id(submodule): name for name, submodule in module.named_modules()}
    tied: Dict[str, str] = {}
    remaining = list(units)
    while True:
        inside = {id(inner) for unit in remaining for inner in unit.modules()}
        root = {
            id(parameter): f"{name}.{parameter_name}".lstrip(".")
            for name, submodule in module.named_modules()
            if id(submodule) not in inside
            for parameter_name, parameter in submodule.named_parameters(recurse=False)
        }
        found = [
            (unit, root[id(parameter)])
            for group in shard_groups(remaining)
            for unit in group
            for parameter in unit.parameters()
            if id(parameter) in root
        ]
        if not found:
            return tied
        for unit, parameter_name in found:
            tied.setdefault(names.get(id(unit), type(unit).__name__), parameter_name)
        dropped = {id(unit) for unit, _ in found}
        for group in shard_groups(remaining):
            ties = [tied[names[id(u)]] for u in group if id(u) in dropped and id(u) in names]
            for unit in group if ties else ():
                tied.setdefault(names.get(id(unit), type(unit).__name__), ties[0])  # tied to a unit tied to the root
                dropped.add(id(unit))
        remaining = [unit for unit in remaining if id(unit) not in dropped]


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


def compile_units(module: torch.nn.Module, units: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """``torch.compile`` each unit in place (``nn.Module.compile``: parameter names and state
    dict keys stay the same). Without units, each direct child of ``module`` that holds
    parameters is compiled instead. Returns what was compiled."""
    targets = units or [child for child in module.children() if any(True for _ in child.parameters())]
    for target in targets:
        target.compile()
    return targets


class CompileTimer:
    """Measures the first training forward and backward once (where ``torch.compile`` compiles)
    and logs it once.

    Example:
        >>> timer = CompileTimer(enabled=True)
        >>> timer.start(); timer.stop()
        >>> timer.seconds is not None
        True
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds: Optional[float] = None
        self._started: Optional[float] = None

    def start(self) -> None:
        if self.enabled and self._started is None:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.enabled and self._started is not None and self.seconds is None:
            self.seconds = time.perf_counter() - self._started
            logger.info("torch.compile: first training step (forward + backward, compilation included) took %.1f s", self.seconds)
