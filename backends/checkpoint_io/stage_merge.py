"""A pipeline's checkpoint: every stage holds other tensors, and rank zero's ``state.pt`` names them all.

Each rank of a pipeline holds its stage's parameters and their optimizer state, keyed by name
(:mod:`backends.checkpoint_io.optimizer_names`). A sharded save writes each rank's tensors (DCP), but
``state.pt`` (rank zero's) lists the tensors by marker: :func:`merged` joins every stage's structure
(the markers of all, each parameter group listing every stage's names), so any layout (another
number of stages, or none) finds every tensor; :func:`pruned` keeps, on load, the entries this
stage holds.

Example:
    >>> first = {"w": {"__sharded__": "module/w"}, "groups": [{"params": ["w"], "lr": 0.1}]}
    >>> second = {"v": {"__sharded__": "module/v"}, "groups": [{"params": ["v"], "lr": 0.1}]}
    >>> merged([first, second])
    {'w': {'__sharded__': 'module/w'}, 'groups': [{'params': ['w', 'v'], 'lr': 0.1}], 'v': {'__sharded__': 'module/v'}}
    >>> pruned(merged([first, second]), {"module/v"})
    {'groups': [{'params': ['w', 'v'], 'lr': 0.1}], 'v': {'__sharded__': 'module/v'}}
"""

from typing import Any, Collection, Dict, List, Sequence

from backends.checkpoint_io.sharded_state import MARKER_KEY


def _is_marker(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {MARKER_KEY}


def merged(states: Sequence[Any]) -> Any:
    """Every stage's ``state`` joined: dictionaries by key (the first stage's value where they agree),
    lists of names (a parameter group's) as their ordered union, lists of the same length item by item;
    anything else is the first stage's."""
    first = states[0]
    if _is_marker(first):
        return first
    if isinstance(first, dict):
        keys: Dict[Any, None] = {}
        for state in states:
            if isinstance(state, dict):
                keys.update(dict.fromkeys(state))
        return type(first)(
            (key, merged([state[key] for state in states if isinstance(state, dict) and key in state])) for key in keys
        )
    if isinstance(first, list) and all(isinstance(state, list) for state in states):
        if all(isinstance(item, str) for state in states for item in state):
            return list(dict.fromkeys(item for state in states for item in state))
        if len({len(state) for state in states}) == 1:
            return [merged([state[index] for state in states]) for index in range(len(first))]
    return first


def pruned(state: Any, held: Collection[str]) -> Any:
    """``state`` without the markers of tensors this stage does not hold (``held``: the paths it loads)."""
    if isinstance(state, dict):
        kept = {key: pruned(value, held) for key, value in state.items() if not _is_marker(value) or value[MARKER_KEY] in held}
        return type(state)(kept)
    if isinstance(state, list):
        items: List[Any] = [pruned(value, held) for value in state]
        return items
    return state
