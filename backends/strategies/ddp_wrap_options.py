"""The keyword arguments a :class:`~backends.strategies.ddp.DDP` strategy passes on to ``DistributedDataParallel``.

``DDP(wrap_options={"bucket_cap_mb": 50, "static_graph": True})`` (or an override of
``DDP.ddp_kwargs``) tunes the wrapper without copying ``DDP.wrap_module``. Names are checked
against ``DistributedDataParallel``'s own signature (so a new torch's parameters are accepted);
the ones the strategy must control are refused with the reason.
"""

import difflib
import inspect
from typing import Any, Dict, Mapping, Optional

from torch.nn.parallel import DistributedDataParallel

CONTROLLED_BY_THE_STRATEGY: Dict[str, str] = {
    "module": "the strategy wraps the trainer's module",
    "device_ids": "the strategy places each rank on its device (use_gpu and the launcher's LOCAL_RANK)",
    "output_device": "the strategy places each rank on its device (use_gpu and the launcher's LOCAL_RANK)",
    "process_group": "the strategy creates, owns and destroys the process group",
    "device_mesh": "the strategy creates, owns and destroys the process group",
    "find_unused_parameters": "it has its own option: DDP(find_unused_parameters=...) / TrainerArguments.find_unused_parameters",
    "mixed_precision": "precision is the backend's precision plugin's job (MixedPrecision, TrueBF16), not the strategy's",
}
"""``DistributedDataParallel`` parameters a wrap option may not set, with the reason."""


def wrap_parameters() -> Dict[str, Any]:
    """``DistributedDataParallel``'s keyword parameters a wrap option may set, with their defaults.

    Example:
        >>> {"bucket_cap_mb", "gradient_as_bucket_view", "static_graph"} <= set(wrap_parameters())
        True
        >>> "device_ids" in wrap_parameters()
        False
    """
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {
        name: parameter.default
        for name, parameter in parameters.items()
        if name != "self" and name not in CONTROLLED_BY_THE_STRATEGY and parameter.kind is not parameter.VAR_KEYWORD
    }


def check_wrap_options(options: Optional[Mapping[str, Any]], given_as: str) -> Dict[str, Any]:
    """``options`` as a dict, once every name is a ``DistributedDataParallel`` parameter the strategy does not control.

    Args:
        options: the keyword arguments (None: none).
        given_as: where they come from, for the error message (``"DDP(wrap_options=...)"``).

    Raises:
        TypeError: ``options`` is not a mapping of names.
        ValueError: a name the strategy controls (with the reason) or no ``DistributedDataParallel``
            parameter (with the closest one and every allowed name).

    Example:
        >>> check_wrap_options({"static_graph": True}, "DDP(wrap_options=...)")
        {'static_graph': True}
        >>> check_wrap_options({"bucket_cap": 50}, "DDP(wrap_options=...)")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: DDP(wrap_options=...): 'bucket_cap' is not a DistributedDataParallel parameter; did you mean ...
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(name, str) for name in options):
        raise TypeError(f"{given_as} must be a mapping of DistributedDataParallel parameter names to values, got {options!r}")
    allowed = wrap_parameters()
    for name in options:
        if name in CONTROLLED_BY_THE_STRATEGY:
            raise ValueError(f"{given_as}: {name!r} cannot be set here: {CONTROLLED_BY_THE_STRATEGY[name]}")
        if name not in allowed:
            close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{given_as}: {name!r} is not a DistributedDataParallel parameter; {hint}allowed: {', '.join(allowed)}"
            )
    return dict(options)
