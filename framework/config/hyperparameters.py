"""A module's hyper-parameters (``ModuleInterface.save_hyperparameters``, as Lightning names it).

They are captured from the calling ``__init__``'s arguments (or given by name, or as a dict),
checked to be plain values (None, bool, int, float, str, and lists, tuples and string-keyed
dicts of them: what ``config.yaml`` and a ``weights_only`` checkpoint can hold), written to the
run's ``config.yaml`` as its ``hyper_parameters`` section (``--config`` reads past it: it is a
record, not a setting) and kept in checkpoints under the module state's ``hyper_parameters``.
"""

import argparse
import inspect
import logging
import types
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("framework")

HYPER_PARAMETERS_KEY = "hyper_parameters"
"""The ``config.yaml`` section and the module-state key (Lightning's checkpoint key) that hold them."""

_SCALARS = (type(None), bool, int, float, str)


class AttributeDict(dict):
    """A dict whose keys read and write as attributes (``hparams.lr``), as Lightning's ``self.hparams``.

    Example:
        >>> hparams = AttributeDict(lr=0.1)
        >>> hparams.lr, hparams["lr"]
        (0.1, 0.1)
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyper-parameter {name!r}; saved: {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class UnwritableHyperParameter(ValueError):
    """A hyper-parameter ``config.yaml`` cannot hold and read back (a cycle, too deep, too many values),
    named with where and why; refused when it is saved, so no unreadable file is ever written."""


CONFIG_LEVELS = 2
"""How deep a hyper-parameter's value starts in ``config.yaml`` (the document, then ``hyper_parameters``)."""
CONFIG_RESERVE = 1000
"""Values of ``config.yaml`` kept for the run's own sections (``trainer``, ``checkpointer``...: a few hundred)."""


def unplain_path(value: Any, path: str = "") -> Optional[str]:
    """Where in ``value`` a value that is not plain sits (``""``: ``value`` itself; None: all plain).
    Walked without recursion; a list or dict that holds itself is :class:`UnwritableHyperParameter`.

    Example:
        >>> unplain_path({"sizes": [1, 2], "name": "mlp"}) is None, unplain_path({"sizes": [1, object()]})
        (True, "['sizes'][1]")
    """
    found, _, _ = _walk(value, path)
    return found


def check_writable(values: Mapping[str, Any]) -> None:
    """Refuse hyper-parameters that ``config.yaml`` could not hold within the bounds its reader keeps
    (:mod:`framework.config.bounded_yaml`): nesting past ``MAX_DEPTH`` with the file's own levels, or more
    than ``MAX_VALUES`` values in all. A cycle is refused by the walk itself.

    Raises:
        UnwritableHyperParameter: naming the hyper-parameter, its size or depth and the bound.

    Example:
        >>> check_writable({"vocabulary": ["a"] * 100_001})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        framework.config.hyperparameters.UnwritableHyperParameter: save_hyperparameters: vocabulary holds 100002 values; ...
    """
    from framework.config.bounded_yaml import MAX_DEPTH, MAX_VALUES

    sizes: Dict[str, int] = {}
    for name, value in values.items():
        _, count, depth = _walk(value, str(name))
        if depth + CONFIG_LEVELS > MAX_DEPTH:
            raise UnwritableHyperParameter(
                f"save_hyperparameters: {name} is nested {depth} levels deep; config.yaml holds at most "
                f"{MAX_DEPTH - CONFIG_LEVELS} levels in a hyper-parameter (its reader refuses deeper files): flatten it, "
                f"or pass ignore=[{str(name)!r}]"
            )
        sizes[str(name)] = count
    total = sum(sizes.values()) + len(sizes)
    if total + CONFIG_RESERVE > MAX_VALUES:
        largest = max(sizes, key=lambda key: sizes[key])
        raise UnwritableHyperParameter(
            f"save_hyperparameters: {largest} holds {sizes[largest]} values; config.yaml holds at most {MAX_VALUES} in all, "
            f"{MAX_VALUES - CONFIG_RESERVE} of them hyper-parameters (its reader refuses larger files; these hold {total}): "
            f"save it to a file and keep its path "
            f"as the hyper-parameter, or pass ignore=[{largest!r}]"
        )


def _walk(value: Any, path: str) -> Tuple[Optional[str], int, int]:
    """(the path of the first value that is not plain or None, how many values, how deep the containers nest),
    without recursion. Raises :class:`UnwritableHyperParameter` for a list or dict that holds itself."""
    first: Optional[str] = None
    count, deepest = 0, 0
    on_path: Dict[int, str] = {}  # id -> path of each container being walked (a cycle returns to one)
    stack: List[Tuple[Any, str, int, bool]] = [(value, path, 0, False)]
    while stack:
        item, where, depth, leaving = stack.pop()
        if leaving:
            del on_path[id(item)]
            continue
        count += 1
        if isinstance(item, _SCALARS):
            continue
        if not isinstance(item, (list, tuple, dict)):
            first = where if first is None else first
            continue
        if id(item) in on_path:
            raise UnwritableHyperParameter(
                f"save_hyperparameters: {where} is {on_path[id(item)]} itself (a {type(item).__name__} that contains "
                "itself): config.yaml and checkpoints cannot hold it; save a copy without the cycle"
            )
        deepest = max(deepest, depth + 1)
        on_path[id(item)] = where
        stack.append((item, where, depth, True))
        if isinstance(item, dict):
            count += len(item)  # the keys: values of the YAML too
            children = []
            for key, child in item.items():
                if not isinstance(key, str):
                    first = f"{where}[{key!r}] (a {type(key).__name__} key)" if first is None else first
                    continue
                children.append((child, f"{where}[{key!r}]", depth + 1, False))
        else:
            children = [(child, f"{where}[{index}]", depth + 1, False) for index, child in enumerate(item)]
        stack.extend(reversed(children))
    return first, count, deepest


def _describe(name: str, value: Any, where: str) -> str:
    return f"{name}{where} ({type(value).__name__})" if not where else f"{name}{where}"


def _init_arguments(frame: Optional[types.FrameType], module: Any) -> Dict[str, Any]:
    """The arguments of the ``__init__`` calls of ``module`` on the stack above ``frame`` (a
    subclass's ``__init__`` calling its parent's: the outermost, most derived values win)."""
    collected: Dict[str, Any] = {}
    found = False
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is module:
        found = True
        info = inspect.getargvalues(frame)
        values = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
        if info.varargs and info.locals.get(info.varargs):
            values[info.varargs] = list(info.locals[info.varargs])
        if info.keywords:
            values.update(info.locals.get(info.keywords) or {})
        collected.update(values)  # an outer (derived) __init__'s values override its parent's
        frame = frame.f_back
    if not found:
        raise RuntimeError(
            f"save_hyperparameters() without arguments reads the arguments of {type(module).__name__}.__init__: call it "
            f"inside __init__, or give the names (save_hyperparameters('lr', 'hidden')) or a dict"
        )
    return collected


def capture(
    module: Any, given: Sequence[Any], ignore: Sequence[str], frame: Optional[types.FrameType]
) -> Tuple[Dict[str, Any], List[str]]:
    """The hyper-parameters ``save_hyperparameters(*given, ignore=ignore)`` saves, and the
    arguments it skipped because their values are not plain (read from ``__init__`` only: a
    value named or given in a dict that is not plain is refused).

    Raises:
        TypeError: a named or given value is not plain (the message names it and says what is allowed).
        ValueError: a name that is not an argument of ``__init__``.
    """
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    if len(given) == 1 and isinstance(given[0], (Mapping, argparse.Namespace)):
        source = given[0]
        values = dict(vars(source) if isinstance(source, argparse.Namespace) else source)
        explicit = True
    elif all(isinstance(name, str) for name in given):
        arguments = _init_arguments(frame, module)
        if given:
            unknown = [name for name in given if name not in arguments]
            if unknown:
                raise ValueError(
                    f"save_hyperparameters{tuple(given)}: {unknown} are not arguments of __init__; it has {sorted(arguments)}"
                )
            values = {name: arguments[name] for name in given}
        else:
            values = arguments
        explicit = bool(given)
    else:
        kinds = [type(item).__name__ for item in given]
        raise TypeError(f"save_hyperparameters takes argument names (str), or one dict or Namespace; got {kinds}")
    values = {name: value for name, value in values.items() if name not in ignore}
    found = {name: unplain_path(value, str(name)) for name, value in values.items()}
    found = {name: where[len(str(name)) :] if where is not None else None for name, where in found.items()}
    bad = {name: where for name, where in found.items() if where is not None}
    if bad and explicit:
        described = ", ".join(_describe(name, values[name], where) for name, where in bad.items())
        raise TypeError(
            f"save_hyperparameters: {described} cannot be saved in config.yaml or a checkpoint; hyper-parameters are None, "
            "bool, int, float, str, and lists and string-keyed dicts of them (a tensor or module belongs in the model's weights)"
        )
    skipped = [f"{name} ({type(values.pop(name)).__name__})" for name in bad]
    if skipped:
        logger.warning(
            "save_hyperparameters: skipped %s: not plain values (the model's weights keep modules and tensors); "
            "pass ignore=%r to say so",
            ", ".join(skipped),
            sorted(bad),
        )
    check_writable(values)
    return values, sorted(bad)


def add_to_config(args: Any, hyper_parameters: Mapping[str, Any]) -> None:
    """Put ``hyper_parameters`` into the run configuration the trainer writes to ``config.yaml``
    (``args``: the trainer's own :class:`~framework.TrainerArguments` copy).

    Example:
        >>> from framework import TrainerArguments
        >>> from framework.config.cli import resolved_config
        >>> args = TrainerArguments()
        >>> add_to_config(args, {"lr": 0.1})
        >>> resolved_config(args).to_dict()["hyper_parameters"]
        {'lr': 0.1}
    """
    from framework.config.cli import RunConfig, resolved_config

    check_writable(hyper_parameters)  # hparams may have changed since they were saved
    config = resolved_config(args)
    if args.run_config is not config:
        args.run_config = config = RunConfig(dict(config.sections))
    config.sections[HYPER_PARAMETERS_KEY] = dict(hyper_parameters)
    setattr(config, HYPER_PARAMETERS_KEY, config.sections[HYPER_PARAMETERS_KEY])
