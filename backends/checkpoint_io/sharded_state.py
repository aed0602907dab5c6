"""A checkpoint's state as its sharded tensors and the rest: each tensor replaced by a marker that
names its path (``{"__sharded__": "module/w"}``), written to ``state.pt`` beside DCP's shards."""

from typing import Any, Dict, List, Tuple

import torch

from backends.checkpoint_io.base import CorruptCheckpoint

STATE_FILE = "state.pt"
MARKER_KEY = "__sharded__"


def split_sharded(data: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(tensors, rest)``: the tensors of the module state, the optimizer and the callback states, keyed by
    their path (``"module/model/head.weight"``, ``"trainer/optimizers/0/state/3/exp_avg"``), and
    ``data`` with each of them replaced by a ``{"__sharded__": path}`` marker.

    Example:
        >>> tensors, rest = split_sharded({"module": {"w": torch.ones(2)}, "trainer": {"optimizers": []}, "epoch": 1})
        >>> list(tensors), rest["module"]
        (['module/w'], {'w': {'__sharded__': 'module/w'}})
    """
    tensors: Dict[str, torch.Tensor] = {}

    def replace(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {MARKER_KEY: path}
        if isinstance(value, dict):
            return type(value)((key, replace(item, f"{path}/{key}")) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(replace(item, f"{path}/{index}") for index, item in enumerate(value))
        return value

    rest = dict(data)
    rest["module"] = replace(data["module"], "module")
    trainer = dict(data.get("trainer", {}))
    trainer["optimizers"] = replace(trainer.get("optimizers", []), "trainer/optimizers")
    trainer["callbacks"] = replace(trainer.get("callbacks", []), "trainer/callbacks")  # EMA's sharded average
    rest["trainer"] = trainer
    return tensors, rest


def fill_sharded(rest: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_sharded`: markers replaced by ``tensors[path]``."""
    if isinstance(rest, dict):
        if set(rest) == {MARKER_KEY}:
            return tensors[rest[MARKER_KEY]]
        return type(rest)((key, fill_sharded(value, tensors)) for key, value in rest.items())
    if isinstance(rest, (list, tuple)):
        return type(rest)(fill_sharded(value, tensors) for value in rest)
    return rest


MAX_STATE_DEPTH = 100
"""The deepest nesting of dicts, lists and tuples ``state.pt`` may hold (the framework's own: under 10)."""


def marker_paths(rest: Any) -> List[str]:
    """Every sharded tensor's path named by a marker in ``rest``, in order; walked without recursion.

    Raises:
        CorruptCheckpoint: ``rest`` nests deeper than :data:`MAX_STATE_DEPTH` or holds itself (a pickle can
            make either; a recursive walk would end in ``RecursionError``), or a marker names no string path.

    Example:
        >>> marker_paths({"module": {"w": {"__sharded__": "module/w"}}, "epoch": 1})
        ['module/w']
    """
    paths: List[str] = []
    on_path: Dict[int, int] = {}  # id -> depth of each container being walked
    stack: List[Tuple[Any, int, bool]] = [(rest, 1, False)]
    while stack:
        value, depth, leaving = stack.pop()
        if leaving:
            on_path.pop(id(value), None)
            continue
        if not isinstance(value, (dict, list, tuple)):
            continue
        if depth > MAX_STATE_DEPTH:
            raise CorruptCheckpoint(f"{STATE_FILE} nests deeper than {MAX_STATE_DEPTH} levels (damaged or hand-made)")
        if id(value) in on_path:
            raise CorruptCheckpoint(f"{STATE_FILE} holds a {type(value).__name__} that contains itself (damaged or hand-made)")
        if isinstance(value, dict) and set(value) == {MARKER_KEY}:
            if not isinstance(value[MARKER_KEY], str):
                raise CorruptCheckpoint(f"{STATE_FILE} has a sharded-tensor marker naming a {type(value[MARKER_KEY]).__name__}")
            paths.append(value[MARKER_KEY])
            continue
        on_path[id(value)] = depth
        stack.append((value, depth, True))
        children = list(value.values()) if isinstance(value, dict) else list(value)
        stack.extend((child, depth + 1, False) for child in reversed(children))
    return paths
