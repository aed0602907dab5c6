"""LightningCLI-style ``class_path`` / ``init_args`` sections: the module (and its optimizer) built
from the config.

.. code-block:: yaml

    model:
      class_path: digits.DigitsClassifier
      init_args: {hidden_size: 256}
    optimizer:                 # handed to the module as ``optimizer=`` (a callable: params -> optimizer)
      class_path: torch.optim.SGD
      init_args: {lr: 0.05, momentum: 0.9}

``--model.init_args.hidden_size 64`` and ``--optimizer.class_path torch.optim.AdamW`` override them on
the command line. Classes and argument names are checked when the config is parsed, so a typo is
a config error (with a suggestion), not a failure after the run started.
"""

import difflib
import functools
import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Dict, List

import torch

OPTIMIZER_SECTION = "optimizer"
_KEYS = ("class_path", "init_args")


def is_class_spec(value: Any) -> bool:
    """True for ``{"class_path": ..., "init_args": {...}}`` (``init_args`` optional).

    Example:
        >>> is_class_spec({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2}}), is_class_spec({"lr": 1})
        (True, False)
    """
    return isinstance(value, Mapping) and "class_path" in value and set(value) <= set(_KEYS)


def import_class(path: Any) -> Any:
    """The class (or callable) ``package.module.Name`` names.

    Raises:
        ValueError: ``path`` is not dotted, the module does not import, or it has no such name.

    Example:
        >>> import_class("torch.optim.SGD").__name__
        'SGD'
    """
    module_name, _, name = str(path).rpartition(".")
    if not isinstance(path, str) or not module_name:
        raise ValueError(f"class_path {path!r} must name a class as 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"class_path {path!r}: cannot import {module_name!r} ({error})") from None
    if not hasattr(module, name):
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f"; did you mean '{module_name}.{close[0]}'?" if close else ""
        raise ValueError(f"class_path {path!r}: {module_name} has no {name!r}{hint}")
    return getattr(module, name)


def check_class_spec(section: str, spec: Mapping[str, Any]) -> List[str]:
    """Every mistake in one section's spec (class, argument names; nested specs too), as messages.

    Example:
        >>> check_class_spec("optimizer", {"class_path": "torch.optim.SGD", "init_args": {"lrr": 0.1}})
        ["optimizer.init_args.lrr: torch.optim.SGD takes no argument 'lrr'; did you mean 'lr'?"]
    """
    try:
        cls = import_class(spec.get("class_path"))
    except ValueError as error:
        return [f"{section}.class_path: {error}"]
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        return [f"{section}.init_args must be a mapping of argument names to values, got {init_args!r}"]
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return []
    errors = []
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    for name, value in init_args.items():
        if name not in parameters and not takes_any:
            close = difflib.get_close_matches(str(name), list(parameters), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {list(parameters)}"
            errors.append(f"{section}.init_args.{name}: {spec['class_path']} takes no argument {name!r}{hint}")
        elif is_class_spec(value):
            errors.extend(check_class_spec(f"{section}.init_args.{name}", value))
    return errors


def build(spec: Mapping[str, Any], **extra: Any) -> Any:
    """``class_path(**init_args, **extra)``; a nested spec is built first, except an optimizer's,
    which becomes a callable ``params -> optimizer`` (an optimizer needs the module's parameters).

    Example:
        >>> build({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 3}}).weight.shape
        torch.Size([3, 2])
    """
    arguments = {name: _argument(value) for name, value in (spec.get("init_args") or {}).items()}
    return import_class(spec["class_path"])(**arguments, **extra)


def optimizer_factory(spec: Mapping[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    """``params -> class_path(params, **init_args)`` for an optimizer section.

    Example:
        >>> make = optimizer_factory({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}})
        >>> make(torch.nn.Linear(2, 2).parameters()).defaults["lr"]
        0.5
    """
    return functools.partial(import_class(spec["class_path"]), **dict(spec.get("init_args") or {}))


def is_class_override(key: str) -> bool:
    """True for the command-line keys ``SECTION.class_path`` and ``SECTION.init_args.NAME``.

    Example:
        >>> is_class_override("model.init_args.width"), is_class_override("trainer.epochs")
        (True, False)
    """
    _, _, rest = key.partition(".")
    return rest == "class_path" or rest.startswith("init_args.")


def apply_class_override(specs: Dict[str, Dict[str, Any]], key: str, text: str) -> bool:
    """Apply ``--SECTION.class_path X`` or ``--SECTION.init_args.NAME VALUE`` (a YAML value; nested:
    ``--model.init_args.config.init_args.width 64``) to ``specs``; False (nothing changed) for any other key.

    Example:
        >>> specs = {}
        >>> apply_class_override(specs, "optimizer.init_args.lr", "0.1"), specs
        (True, {'optimizer': {'init_args': {'lr': 0.1}}})
    """
    if not is_class_override(key):
        return False
    import yaml

    section, *path = key.split(".")  # init_args.config.init_args.width reaches into a nested spec
    node = specs.setdefault(section, {})
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = text if path[-1] == "class_path" else yaml.safe_load(text)
    return True


def _argument(value: Any) -> Any:
    if not is_class_spec(value):
        return value
    cls = import_class(value["class_path"])
    return optimizer_factory(value) if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else build(value)


def build_module(specs: Mapping[str, Mapping[str, Any]], section: str = "model") -> Any:
    """The module ``specs[section]`` describes, given ``optimizer=`` from an ``optimizer`` section
    when there is one (the module must then take an ``optimizer`` argument).

    Raises:
        ValueError: no such section, or an optimizer section for a module that takes none.

    Example:
        module = build_module(config.class_specs)   # what RunConfig.build_module does
    """
    if section not in specs:
        raise ValueError(f"the config has no {section!r} section with a class_path; sections with one: {sorted(specs)}")
    extra: Dict[str, Any] = {}
    if OPTIMIZER_SECTION in specs:
        cls = import_class(specs[section]["class_path"])
        if "optimizer" not in inspect.signature(cls).parameters:
            raise ValueError(
                f"the config has an optimizer section, but {specs[section]['class_path']} takes no 'optimizer' argument; "
                "add one (a callable: params -> optimizer) or leave the section out"
            )
        extra["optimizer"] = optimizer_factory(specs[OPTIMIZER_SECTION])
    return build(specs[section], **extra)
