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
import os
import sys
import sysconfig
import typing
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import torch

from framework.config.bounded_repr import bounded_repr
from framework.config.lightning_names import lightning_callback_hint

OPTIMIZER_SECTION = "optimizer"
SCHEDULER_SECTION = "lr_scheduler"
DATA_SECTION = "data"
HANDED_TO_MODEL = (OPTIMIZER_SECTION, SCHEDULER_SECTION, DATA_SECTION)
"""Sections built and handed to the model's class as the argument of the same name."""
SPEC_SECTIONS = ("model", *HANDED_TO_MODEL)
"""The top-level sections that may be given as ``class_path`` / ``init_args``."""
ALLOW_ANY_CALLABLE = "FRAMEWORK_CONFIG_ALLOW_ANY_CALLABLE"
"""Environment variable: ``1`` lets a ``class_path`` name any callable (a function, a standard-library
class); without it a ``class_path`` must name a class outside Python's standard library."""
_KEYS = ("class_path", "init_args")
_STDLIB = os.path.normcase(os.path.realpath(sysconfig.get_paths()["stdlib"]))


def is_class_spec(value: Any) -> bool:
    """True for ``{"class_path": ..., "init_args": {...}}`` (``init_args`` optional).

    Example:
        >>> is_class_spec({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2}}), is_class_spec({"lr": 1})
        (True, False)
    """
    return isinstance(value, Mapping) and "class_path" in value and set(value) <= set(_KEYS)


def _from_stdlib(target: Any) -> bool:
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    if module is None or getattr(target, "__module__", "") == "builtins":
        return True
    name = getattr(module, "__name__", "")
    if name in getattr(sys, "stdlib_module_names", ()) or name.split(".")[0] in getattr(sys, "stdlib_module_names", ()):
        return True
    location = getattr(module, "__file__", None)
    if not location:
        return True  # built into the interpreter
    location = os.path.normcase(os.path.realpath(location))
    return location.startswith(_STDLIB + os.sep) and "site-packages" not in location


def check_target(section: str, path: str, target: Any) -> Optional[str]:
    """Why ``target`` (what ``section``'s ``class_path`` names) may not be built there, or None.

    A ``class_path`` names a class outside Python's standard library (so ``os.system`` or
    ``subprocess.Popen`` are refused); an ``optimizer`` section a ``torch.optim.Optimizer``
    subclass, an ``lr_scheduler`` section a ``torch.optim.lr_scheduler`` class. With
    ``FRAMEWORK_CONFIG_ALLOW_ANY_CALLABLE=1`` any callable is allowed (a config is then code).

    Example:
        >>> check_target("optimizer", "torch.nn.Linear", torch.nn.Linear)
        "optimizer.class_path 'torch.nn.Linear' is not an optimizer: the optimizer section names a torch.optim.Optimizer subclass"
    """
    kind = section.rsplit(".", 1)[-1]
    if os.environ.get(ALLOW_ANY_CALLABLE) == "1":
        return None if callable(target) else f"{section}.class_path {path!r} names a {type(target).__name__}, not a callable"
    if not isinstance(target, type):
        return (
            f"{section}.class_path {path!r} names a {type(target).__name__}, not a class; a config builds classes only "
            f"(set {ALLOW_ANY_CALLABLE}=1 to let it call any function)"
        )
    if kind == OPTIMIZER_SECTION and not issubclass(target, torch.optim.Optimizer):
        return f"{section}.class_path {path!r} is not an optimizer: the optimizer section names a torch.optim.Optimizer subclass"
    if kind == SCHEDULER_SECTION and not (
        issubclass(target, torch.optim.lr_scheduler.LRScheduler) or target.__module__.startswith("torch.optim.lr_scheduler")
    ):
        return (
            f"{section}.class_path {path!r} is not a learning-rate scheduler: the lr_scheduler section names a "
            "class of torch.optim.lr_scheduler (or a subclass of LRScheduler)"
        )
    if _from_stdlib(target):
        return (
            f"{section}.class_path {path!r} is a class of Python's standard library, which a config may not build "
            f"(it could run commands or touch files); set {ALLOW_ANY_CALLABLE}=1 if you mean it"
        )
    return None


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
    extra = [key for key in spec if key not in _KEYS]
    if extra:
        close = difflib.get_close_matches(str(extra[0]), _KEYS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return [f"{section}: unknown key {bounded_repr(extra[0])} beside class_path; allowed: class_path, init_args{hint}"]
    if "class_path" not in spec:
        return [f"{section}.init_args given without a class_path naming the class they are for"]
    try:
        cls = import_class(spec.get("class_path"))
    except ValueError as error:
        return [f"{section}.class_path: {error}"]
    refused = check_target(section, str(spec["class_path"]), cls)
    if refused:
        return [refused]
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        return [
            f"{section}.init_args must be a mapping of argument names to values ({{name: value}}), "
            f"got {type(init_args).__name__} {bounded_repr(init_args)}"
        ]
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return []
    hints = _hints(cls)
    errors = []
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    for name, value in init_args.items():
        if name not in parameters and not takes_any:
            close = difflib.get_close_matches(str(name), list(parameters), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {list(parameters)}"
            errors.append(f"{section}.init_args.{name}: {spec['class_path']} takes no argument {name!r}{hint}")
        elif is_class_spec(value):
            errors.extend(check_class_spec(f"{section}.init_args.{name}", value))
        elif name in hints:
            from framework.config.conversion import convert, type_name

            try:
                convert(value, hints[name], from_text=False)
            except (TypeError, ValueError) as error:
                errors.append(
                    f"{section}.init_args.{name}={bounded_repr(value)}: {spec['class_path']} takes "
                    f"{name}: {type_name(hints[name])}; {error}"
                )
    return errors


def check_handed_sections(specs: Mapping[str, Mapping[str, Any]]) -> List[str]:
    """Every ``optimizer`` / ``lr_scheduler`` / ``data`` section that nothing would use: without a ``model``
    section, or for a model class that takes no argument of that name.

    Example:
        >>> check_handed_sections({"lr_scheduler": {"class_path": "torch.optim.lr_scheduler.StepLR"}})[0][:60]
        "the 'lr_scheduler' section is handed to the model section's "
    """
    handed = [name for name in HANDED_TO_MODEL if name in specs and not (name == DATA_SECTION and data_goes_to_trainer(specs))]
    if not handed:
        return []
    if "model" not in specs:
        return [
            f"the {name!r} section is handed to the model section's class as {name}=, but the config has no model "
            "section with a class_path; add one, or leave the section out"
            for name in handed
        ]
    try:
        parameters = inspect.signature(import_class(specs["model"].get("class_path"))).parameters
    except (TypeError, ValueError):
        return []  # reported by check_class_spec
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    return [
        f"the config has a {name!r} section, but {specs['model']['class_path']} takes no {name!r} argument; "
        f"add one ({_HANDED_AS[name]}) or leave the section out"
        for name in handed
        if name not in parameters and not takes_any
    ]


def data_goes_to_trainer(specs: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when the ``data`` section names a :class:`~framework.DataModule` subclass and the ``model``
    section's class (if any) takes no ``data`` argument: the trainer then gets it as ``datamodule=``,
    as LightningCLI hands its ``data`` section to ``trainer.fit(datamodule=)``.

    Example:
        >>> data_goes_to_trainer({"data": {"class_path": "framework.DataModule"}})
        True
    """
    from framework.data.data_module import DataModule

    try:
        cls = import_class(specs[DATA_SECTION].get("class_path")) if DATA_SECTION in specs else None
        model = import_class(specs["model"].get("class_path")) if "model" in specs else None
    except ValueError:  # reported by check_class_spec
        return False
    if not (isinstance(cls, type) and issubclass(cls, DataModule)):
        return False
    try:
        return model is None or DATA_SECTION not in inspect.signature(model).parameters
    except (TypeError, ValueError):
        return True


def config_data_module(args: Any) -> Any:
    """The :class:`~framework.DataModule` the ``data`` section of the config ``args`` came from names,
    built, when it goes to the trainer (see :func:`data_goes_to_trainer`); else None.

    Example:
        >>> from framework import TrainerArguments
        >>> config_data_module(TrainerArguments()) is None
        True
    """
    specs = getattr(getattr(args, "run_config", None), "class_specs", None) or {}
    return build(specs[DATA_SECTION]) if data_goes_to_trainer(specs) else None


_HANDED_AS = {
    OPTIMIZER_SECTION: "a callable: params -> optimizer",
    SCHEDULER_SECTION: "a callable: optimizer -> scheduler",
    DATA_SECTION: "the object the data section builds",
}


def check_callbacks(specs: Any) -> List[str]:
    """Every mistake in ``trainer.callbacks``: a list of ``{class_path, init_args}`` naming Callback classes.

    Example:
        >>> check_callbacks([{"class_path": "framework.callbacks.EarlyStopping", "init_args": {"monitorr": "val"}}])[0][:45]
        'trainer.callbacks[0].init_args.monitorr: fram'
    """
    from framework.callbacks.base import Callback

    if specs is None:
        return []
    if not isinstance(specs, (list, tuple)):
        return [
            f"trainer.callbacks must be a list of {{class_path, init_args}}, got {type(specs).__name__} {bounded_repr(specs)}"
        ]
    errors = []
    for index, spec in enumerate(specs):
        where = f"trainer.callbacks[{index}]"
        if not isinstance(spec, Mapping):
            errors.append(f"{where} must be a mapping {{class_path, init_args}}, got {bounded_repr(spec)}")
            continue
        hint = lightning_callback_hint(str(spec.get("class_path", "")))
        if hint:
            errors.append(f"{where}.class_path {bounded_repr(spec.get('class_path'))}: {hint}")
            continue
        found = check_class_spec(where, spec)
        if not found:
            cls = import_class(spec["class_path"])
            if not (isinstance(cls, type) and issubclass(cls, Callback)):
                found = [f"{where}.class_path {spec['class_path']!r} is not a framework.callbacks.Callback subclass"]
        errors += found
    return errors


def _hints(cls: Any) -> Dict[str, Any]:
    """The type annotations of ``cls``'s constructor (or of a function), {} where they do not resolve."""
    target = cls.__init__ if isinstance(cls, type) else cls  # type: ignore[misc]  # its own constructor
    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: no type check, the names are still checked
        return {}


def build(spec: Mapping[str, Any], **extra: Any) -> Any:
    """``class_path(**init_args, **extra)``; a nested spec is built first, except an optimizer's,
    which becomes a callable ``params -> optimizer`` (an optimizer needs the module's parameters).

    Example:
        >>> build({"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 3}}).weight.shape
        torch.Size([3, 2])
    """
    arguments = {name: _argument(value) for name, value in (spec.get("init_args") or {}).items()}
    return import_class(spec["class_path"])(**arguments, **extra)


def scheduler_factory(spec: Mapping[str, Any]) -> Callable[..., Any]:
    """``optimizer -> class_path(optimizer, **init_args)`` for an ``lr_scheduler`` section.

    Example:
        >>> make = scheduler_factory({"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 3}})
        >>> make(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)).step_size
        3
    """
    return functools.partial(import_class(spec["class_path"]), **dict(spec.get("init_args") or {}))


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
    return rest in ("class_path", "init_args") or rest.startswith("init_args.")


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
    section, *path = key.split(".")  # init_args.config.init_args.width reaches into a nested spec
    node = specs.setdefault(section, {})
    for part in path[:-1]:
        node = node.setdefault(part, {})
    if path[-1] == "class_path":
        node[path[-1]] = text
    else:
        from framework.config.bounded_yaml import YamlRefused, load_yaml

        try:
            node[path[-1]] = load_yaml(text)
        except YamlRefused:
            node[path[-1]] = text  # not YAML: the text itself, checked like any value
    return True


def _argument(value: Any) -> Any:
    if not is_class_spec(value):
        return value
    cls = import_class(value["class_path"])
    return optimizer_factory(value) if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else build(value)


def build_module(specs: Mapping[str, Mapping[str, Any]], section: str = "model") -> Any:
    """The module ``specs[section]`` describes, given ``optimizer=`` from an ``optimizer`` section,
    ``lr_scheduler=`` (a callable ``optimizer -> scheduler``) from an ``lr_scheduler`` section and
    ``data=`` (built) from a ``data`` section when there are (the module must take those arguments); a
    ``data`` section naming a :class:`~framework.DataModule` goes to the trainer instead, unless the module takes ``data``.

    Raises:
        ValueError: no such section, or an optimizer section for a module that takes none.

    Example:
        module = build_module(config.class_specs)   # what RunConfig.build_module does
    """
    if section not in specs:
        raise ValueError(f"the config has no {section!r} section with a class_path; sections with one: {sorted(specs)}")
    problems = check_handed_sections({name: spec for name, spec in specs.items() if name in (section, *HANDED_TO_MODEL)})
    if problems:
        raise ValueError("; ".join(problems))
    extra: Dict[str, Any] = {}
    if OPTIMIZER_SECTION in specs:
        extra[OPTIMIZER_SECTION] = optimizer_factory(specs[OPTIMIZER_SECTION])
    if SCHEDULER_SECTION in specs:
        extra[SCHEDULER_SECTION] = scheduler_factory(specs[SCHEDULER_SECTION])
    if DATA_SECTION in specs and not data_goes_to_trainer(specs):  # a DataModule goes to the trainer
        extra[DATA_SECTION] = build(specs[DATA_SECTION])
    return build(specs[section], **extra)
