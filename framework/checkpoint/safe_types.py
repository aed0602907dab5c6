"""Types user state may hold beyond tensors, accepted by ``weights_only`` loading.

A module's ``get_state()`` (an RL agent's replay buffer, an environment's RNG) often holds
numpy arrays and scalars, numpy's generators and their states, and Python's ``random``
state or a ``random.Random``. ``torch.load(weights_only=True)`` refuses them by default; each
of the globals below only rebuilds such a value from plain data (array bytes, integers, a
bit generator's name looked up in numpy's own table), so allowing them runs no user code.
Arbitrary pickled objects stay refused.

Importing this module registers them once (``torch.serialization.add_safe_globals``).

Example:
    >>> import io, random
    >>> import numpy as np
    >>> buffer = io.BytesIO()
    >>> torch.save({"buffer": np.arange(3), "rng": random.Random(0), "np_rng": np.random.default_rng(0)}, buffer)
    >>> _ = buffer.seek(0)
    >>> state = torch.load(buffer, weights_only=True)
    >>> state["buffer"].tolist(), state["rng"].random() == random.Random(0).random()
    ([0, 1, 2], True)
"""

import importlib
import random
from typing import Any, List

import torch

_NUMPY_GLOBALS = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy._core.multiarray._reconstruct",  # numpy 2
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",  # numpy 1
    "numpy.core.multiarray.scalar",
    "numpy.random._pickle.__generator_ctor",
    "numpy.random._pickle.__bit_generator_ctor",
    "numpy.random._pickle.__randomstate_ctor",
    "numpy.random.mtrand.RandomState",
    "numpy.random._generator.Generator",
    "numpy.random.bit_generator.SeedSequence",
    "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
    "numpy.random._mt19937.MT19937",
    "numpy.random._pcg64.PCG64",
    "numpy.random._pcg64.PCG64DXSM",
    "numpy.random._philox.Philox",
    "numpy.random._sfc64.SFC64",
)


def _resolve(qualified_name: str) -> Any:
    module_name, _, attribute = qualified_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError):
        return None  # another numpy version, or no numpy


def user_state_types() -> List[Any]:
    """The allow-listed globals present in this installation (numpy's only when numpy is installed).

    Example:
        >>> random.Random in user_state_types()
        True
    """
    found = [_resolve(name) for name in _NUMPY_GLOBALS] + _numpy_dtype_classes()
    return [item for item in found if item is not None] + [random.Random]


def _numpy_dtype_classes() -> List[Any]:
    """numpy 2's dtype classes (``numpy.dtypes.Int64DType``...): a pickled dtype is rebuilt as one."""
    try:
        dtypes = importlib.import_module("numpy.dtypes")
    except ImportError:
        return []
    return [getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType")]


torch.serialization.add_safe_globals(user_state_types())
