"""A read-only attribute of the trainer that one of its parts owns: ``trainer.optimizers`` reads
``trainer.training_setup.optimizers``, so each value has one owner and the trainer's public names stay.
"""

import operator
from typing import Any, Callable, Generic, NoReturn, Optional, TypeVar

T = TypeVar("T")


class OwnedBy(Generic[T]):
    """Declares ``name = OwnedBy[type](part, doc)`` in a class: reading ``obj.name`` reads
    ``obj.<part>.name`` (the part's attribute of the same name); assigning it is refused.

    Args:
        part: the attribute of the object that holds the part (e.g. ``"training_setup"``).
        doc: what the value is, for ``help()`` and the API docs.

    Example:
        >>> class Setup:
        ...     optimizers = ["sgd"]
        >>> class Trainer:
        ...     optimizers = OwnedBy[list]("setup", "The optimizers.")
        ...     def __init__(self):
        ...         self.setup = Setup()
        >>> Trainer().optimizers
        ['sgd']
        >>> Trainer().optimizers = []
        Traceback (most recent call last):
        ...
        AttributeError: Trainer.optimizers is read-only: it belongs to Trainer.setup (set Trainer.setup.optimizers)
    """

    def __init__(self, part: str, doc: str) -> None:
        self.part, self.__doc__ = part, doc
        self.name, self.owner = "", ""
        self.read: Callable[[Any], Any] = operator.attrgetter(part)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.owner = name, owner.__name__
        self.read = operator.attrgetter(f"{self.part}.{name}")  # one C call per read

    def __get__(self, obj: Any, owner: Optional[type] = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]  # the class's attribute: the descriptor, for help()
        return self.read(obj)

    def __set__(self, obj: Any, value: Any) -> NoReturn:
        where = f"{self.owner}.{self.part}"
        raise AttributeError(f"{self.owner}.{self.name} is read-only: it belongs to {where} (set {where}.{self.name})")
