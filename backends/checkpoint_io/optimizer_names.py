"""Optimizer state keyed by parameter name, as sharded checkpoints store it.

``optimizer.state_dict()`` numbers parameters by their position in the optimizer
(``state/3/exp_avg``): position 3 is another parameter when the model registers its parameters in
another order, and under a pipeline every stage has its own position 0. Sharded checkpoints key
the state by each parameter's fully qualified name instead (``state/blocks.0.qkv.weight/exp_avg``),
as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does; the parameter groups
list names too. :func:`load_into` reads both layouts, so checkpoints written by position still resume.

Example:
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> state = by_name(optimizer, model)
    >>> state["param_groups"][0]["params"]
    ['weight', 'bias']
    >>> load_into(optimizer, state, model)
"""

from typing import Any, Dict, List, Sequence

import torch


def keyed_by_name(state: Any) -> bool:
    """True when ``state`` (an optimizer's state dict) lists its parameters by name.

    Example:
        >>> keyed_by_name({"state": {}, "param_groups": [{"params": [0, 1]}]})
        False
    """
    groups = state.get("param_groups", []) if isinstance(state, dict) else []
    return any(isinstance(key, str) for group in groups for key in group.get("params", ()))


def _names_in_order(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> List[List[str]]:
    """The name of each parameter of each group of ``optimizer``, in its order.

    Raises:
        ValueError: a parameter of ``optimizer`` is not one of ``module``'s.
    """
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    found = []
    for group_index, group in enumerate(optimizer.param_groups):
        group_names = []
        for position, parameter in enumerate(group["params"]):
            if id(parameter) not in names:
                raise ValueError(
                    f"parameter {position} of the optimizer's group {group_index} (shape {tuple(parameter.shape)}) is not "
                    f"a parameter of the module; a sharded checkpoint keys optimizer state by parameter name: build the "
                    f"optimizer from the module's parameters (self.parameters() in get_optimizers_schedulers)"
                )
            group_names.append(names[id(parameter)])
        found.append(group_names)
    return found


def by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with its state and its groups keyed by ``module``'s parameter names.

    Raises:
        ValueError: the optimizer holds a parameter that is not ``module``'s (it has no name).
    """
    state = optimizer.state_dict()
    positions = [key for group in state["param_groups"] for key in group["params"]]
    names = [name for group in _names_in_order(optimizer, module) for name in group]
    name_of = dict(zip(positions, names))
    return {
        "state": {name_of[key]: value for key, value in state["state"].items()},
        "param_groups": [{**group, "params": [name_of[key] for key in group["params"]]} for group in state["param_groups"]],
    }


def by_position(state: Dict[str, Any]) -> Dict[str, Any]:
    """A name-keyed ``state`` (:func:`by_name`) numbered by position as ``optimizer.state_dict()``
    numbers it (to read a checkpoint written by position into it); unchanged when already by position.

    Example:
        >>> by_position({"state": {"b": {"x": 1}}, "param_groups": [{"params": ["a", "b"]}]})
        {'state': {1: {'x': 1}}, 'param_groups': [{'params': [0, 1]}]}
    """
    if not keyed_by_name(state):
        return state
    order = [name for group in state["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(order)}
    return {
        "state": {position[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [position[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def aligned(saved: Sequence[Any], targets: Sequence[Any]) -> List[Any]:
    """``targets`` (this run's optimizer states) in the layout of the checkpoint's ``saved`` ones:
    numbered by position where the checkpoint was written by position (before names)."""
    return [
        by_position(target) if isinstance(target, dict) and index < len(saved) and not keyed_by_name(saved[index]) else target
        for index, target in enumerate(targets)
    ]


def load_into(optimizer: torch.optim.Optimizer, state: Dict[str, Any], module: torch.nn.Module, one_stage: bool = False) -> None:
    """``optimizer.load_state_dict`` of ``state`` by name (each parameter gets its own name's state,
    whatever the order of the module's parameters), or by position for a ``state`` written by position.
    ``one_stage``: ``module`` is one stage of a pipeline, and ``state`` may name the other stages' parameters too.

    Raises:
        ValueError: the groups of ``state`` name other parameters than this optimizer's (naming them).
    """
    if not keyed_by_name(state):
        optimizer.load_state_dict(state)
        return
    current = _names_in_order(optimizer, module)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(current):
        raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this run's {len(current)}")
    position = {name: index for index, name in enumerate(name for names in current for name in names)}
    groups = []
    for index, (saved, names) in enumerate(zip(saved_groups, current)):
        differing = sorted(set(names) - set(saved["params"]) if one_stage else set(saved["params"]) ^ set(names))
        if differing:
            raise ValueError(
                f"parameter group {index} of the checkpoint's optimizer holds other parameters than this run's: "
                f"{differing[:5]}{' ...' if len(differing) > 5 else ''} (in one, not the other); resume with the same "
                "model and parameter groups, or set checkpointer_args.reset_optimizers_schedulers=True"
            )
        groups.append({**saved, "params": [position[name] for name in names]})
    states = {position[name]: value for name, value in state["state"].items() if name in position}
    optimizer.load_state_dict({"state": states, "param_groups": groups})
