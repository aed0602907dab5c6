"""Options a backend declares for itself, beside the built-in ones of :mod:`backends.options`.

A plugin declares them when it registers, ``register_backend("my-ddp", factory, options={...})``,
or as a ``declared_options`` attribute of its factory (a ``TrainerBackend`` subclass, say, found
through an entry point). A run sets them in ``TrainerArguments.backend_options`` (on the command
line ``--trainer.backend_options.NAME VALUE``); the factory receives each declared option as a
keyword argument: the run's value, else the declared default. A name the chosen backend does
not declare is refused with the closest declared one, like a mistyped config key.

backends/ never imports framework/: this file reads plain mappings.
"""

import dataclasses
import difflib
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

TypeSpec = Union[type, Tuple[type, ...]]

_declared: Dict[str, Tuple[Any, Dict[str, "BackendOption"]]] = {}
"""``{backend name: (factory, declarations)}``, kept by :mod:`backends.registry`; an entry holds while
that factory is the one registered under the name."""


@dataclasses.dataclass(frozen=True)
class BackendOption:
    """One option a backend declares: its default, one line of help, and what values it takes.

    Args:
        default: the value a run gets when it does not set the option.
        help: one line, shown by ``--help`` under the backend's name.
        type: the type (or tuple of types) a value must have; default: the default's type
            (None as the default: any value). ``bool`` is not an ``int``; an ``int`` is a ``float``.
        choices: the only values allowed, if only some are.

    Example:
        >>> BackendOption(25, "DDP bucket size in MB").check("bucket_cap_mb", 50, "my-ddp")
        50
        >>> BackendOption(25).check("bucket_cap_mb", "fifty", "my-ddp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend_options.bucket_cap_mb='fifty' is invalid for backend 'my-ddp'; allowed: int (default 25)
    """

    default: Any
    help: str = ""
    type: Optional[TypeSpec] = None
    choices: Optional[Tuple[Any, ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.help, str):
            raise TypeError(f"BackendOption(help={self.help!r}) must be a string")
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))
        if self.type is None and self.default is not None:
            object.__setattr__(self, "type", type(self.default))

    @property
    def type_name(self) -> str:
        """The allowed type(s) in words, as ``--help`` shows them."""
        if self.type is None:
            return "any"
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        return " or ".join(getattr(kind, "__name__", str(kind)) for kind in types)

    def check(self, name: str, value: Any, backend: str) -> Any:
        """``value`` when it is one the option takes.

        Raises:
            ValueError: naming the option, the backend and what is allowed.
        """
        fits = self.type is None or _fits(value, self.type) or (value is None and self.default is None)
        if fits and (self.choices is None or value in self.choices):
            return value
        allowed = f"one of {list(self.choices)!r}" if self.choices is not None else self.type_name
        raise ValueError(
            f"backend_options.{name}={value!r} is invalid for backend {backend!r}; allowed: {allowed} (default {self.default!r})"
        )


def _fits(value: Any, kind: TypeSpec) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for one in kinds:
        if one is bool and isinstance(value, bool):
            return True
        if one is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if one is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if one not in (bool, int, float) and isinstance(one, type) and isinstance(value, one):
            return True
    return False


def declare_options(
    backend: str, declared: Optional[Mapping[str, Any]], built_in: AbstractSet[str] = frozenset()
) -> Dict[str, BackendOption]:
    """A backend's declarations as ``{name: BackendOption}``.

    Each value is a :class:`BackendOption`, a ``(default, help)`` pair, or a bare default.

    Raises:
        ValueError: a name that is not an identifier, or is in ``built_in`` (the built-in backend
            options, ``TrainerArguments.compile``, ...: those are set as trainer fields).
        TypeError: ``declared`` is not a mapping, or a value is none of the above.

    Example:
        >>> declare_options("my-ddp", {"bucket_cap_mb": (25, "DDP bucket size in MB"), "static_graph": False})
        {'bucket_cap_mb': BackendOption(default=25, help='DDP bucket size in MB', type=<class 'int'>, choices=None), \
'static_graph': BackendOption(default=False, help='', type=<class 'bool'>, choices=None)}
    """
    if declared is None:
        return {}
    if not isinstance(declared, Mapping):
        raise TypeError(f"options of backend {backend!r} must be a mapping of names to BackendOption, got {declared!r}")
    options: Dict[str, BackendOption] = {}
    for name, value in declared.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"backend {backend!r} declares option {name!r}; allowed: a Python identifier such as 'bucket_cap_mb'"
            )
        if name in built_in:
            raise ValueError(
                f"backend {backend!r} declares option {name!r}, which is a built-in backend option (TrainerArguments.{name}); "
                "read that one from the run's arguments (backends.options.option(args, name)) and pick another name for yours"
            )
        if isinstance(value, BackendOption):
            options[name] = value
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
            options[name] = BackendOption(value[0], value[1])
        elif isinstance(value, tuple):
            raise TypeError(
                f"option {name!r} of backend {backend!r} is {value!r}; allowed: BackendOption(...), (default, 'help') "
                "or a bare default"
            )
        else:
            options[name] = BackendOption(value)
    return options


def record_declarations(name: str, factory: Any, declared: Optional[Dict[str, BackendOption]]) -> None:
    """Keep (``declared`` a dict) or forget (None) what the backend ``name``, built by ``factory``, declares."""
    if declared is None:
        _declared.pop(name, None)
    else:
        _declared[name] = (factory, declared)


def declarations_of(name: str, factory: Any) -> Dict[str, BackendOption]:
    """What the backend ``name`` declares, while ``factory`` is the one registered under it (else ``{}``)."""
    recorded, declared = _declared.get(name, (None, {}))
    return dict(declared) if recorded is factory and factory is not None else {}


def declared_elsewhere(
    name: Optional[str], registered: Optional[Mapping[str, Any]] = None
) -> Dict[str, List[Tuple[str, BackendOption]]]:
    """``{option: [(backend, declaration), ...]}`` over the backends in ``registered`` (name to factory;
    None: every backend that declared options) other than ``name``.

    Example:
        >>> declared_elsewhere(None, {})
        {}
    """
    found: Dict[str, List[Tuple[str, BackendOption]]] = {}
    for other, (factory, options) in sorted(_declared.items()):
        if other != name and (registered is None or registered.get(other) is factory):
            for option_name, declaration in options.items():
                found.setdefault(option_name, []).append((other, declaration))
    return found


def resolve_options(
    backend: str,
    declared: Mapping[str, BackendOption],
    given: Optional[Mapping[str, Any]],
    declared_by_others: Mapping[str, Sequence[Tuple[str, BackendOption]]] = {},
) -> Dict[str, Any]:
    """Every option ``backend`` declares, at the run's value (``given``) or its default.

    A given name the backend does not declare is refused, unless another backend declares it
    and the value is that backend's default (a config saved by a run of that backend, loaded
    with another ``--backend``: a default means "not set", as for the built-in options).

    Args:
        backend: the backend's name, for messages.
        declared: its declarations.
        given: ``TrainerArguments.backend_options`` (None: nothing given).
        declared_by_others: ``{option name: [(backend name, declaration), ...]}`` of the other
            registered backends, to say which backend an option belongs to.

    Raises:
        ValueError: every refused name or value at once, one per line.

    Example:
        >>> declared = declare_options("my-ddp", {"bucket_cap_mb": (25, "DDP bucket size in MB")})
        >>> resolve_options("my-ddp", declared, {}), resolve_options("my-ddp", declared, {"bucket_cap_mb": 50})
        ({'bucket_cap_mb': 25}, {'bucket_cap_mb': 50})
        >>> resolve_options("my-ddp", declared, {"bucket_cap": 50})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend_options.bucket_cap=50 is not an option of backend 'my-ddp'; did you mean 'bucket_cap_mb'? ...
    """
    if given is None:
        given = {}
    if not isinstance(given, Mapping) or not all(isinstance(name, str) for name in given):
        raise ValueError(f"backend_options={given!r} is invalid; allowed: a mapping of option names to values")
    values = {name: option.default for name, option in declared.items()}
    errors: List[str] = []
    for name, value in given.items():
        if name in declared:
            try:
                values[name] = declared[name].check(name, value, backend)
            except ValueError as error:
                errors.append(str(error))
            continue
        owners = declared_by_others.get(name, ())
        if any(_same(value, option.default) for _, option in owners):
            continue  # another backend's option at its default: not set
        errors.append(_not_declared(backend, declared, name, value, [owner for owner, _ in owners]))
    if errors:
        raise ValueError("\n".join(errors))
    return values


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def _not_declared(backend: str, declared: Mapping[str, BackendOption], name: str, value: Any, owners: List[str]) -> str:
    given = f"backend_options.{name}={value!r}"
    belongs = f" ({name!r} is an option of {', '.join(repr(owner) for owner in owners)})" if owners else ""
    if not declared:
        return f"{given} does not apply to backend {backend!r}: it declares no backend_options{belongs}"
    close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{given} is not an option of backend {backend!r}; {hint}allowed: {', '.join(declared)}{belongs}"
