"""Seeding and capturing the random number generators a training run draws from."""

import random
from typing import Any, Dict, Tuple, cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy and torch (CPU and every CUDA device).

    Example:
        >>> seed_everything(0); first = torch.rand(1)
        >>> seed_everything(0); torch.equal(first, torch.rand(1))
        True
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> Dict[str, Any]:
    """The state of every generator of this process, as tensors and plain values.

    Covers python's ``random``, numpy's global generator, torch's CPU generator and, once
    CUDA is initialised, every CUDA device's generator. Only tensors, numbers, strings and
    lists: safe for ``torch.load(weights_only=True)``.

    Example:
        >>> state = capture_rng_state()
        >>> first = torch.rand(1)
        >>> restore_rng_state(state)
        >>> torch.equal(first, torch.rand(1))
        True
    """
    kind, keys, position, has_gauss, cached_gaussian = cast(Tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, internal, gauss = random.getstate()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states are restored when CUDA is available)."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
