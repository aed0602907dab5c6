"""The ``cuda`` tier's guards and defaults (``tests/cuda/``: every test there is marked ``cuda``).

Where no CUDA device exists each test is skipped with a reason naming CUDA (never failing);
tests that need several devices are skipped where fewer are visible. Nothing slow is imported
here: the guards read ``torch.cuda.is_available()`` and ``device_count()`` only, so the tier
collects in moments on a CPU-only machine.
"""

import functools
from typing import Any, List

import pytest
import torch

from toy import toy_args

HAS_CUDA = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0

NO_CUDA_REASON = (
    "needs a CUDA device (torch.cuda.is_available() is False here); "
    "run `python -m pytest -m cuda` on a GPU machine (CONTRIBUTING.md, 'On a GPU machine')"
)

CUDA_TIER: List[Any] = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)]
"""``pytestmark = CUDA_TIER`` in each file of the tier: the marker, and the skip where there is no device."""


def requires_gpus(count: int) -> Any:
    """Skip where fewer than ``count`` CUDA devices are visible (NCCL runs one process per device)."""
    return pytest.mark.skipif(
        count > GPU_COUNT,
        reason=f"needs {count} CUDA devices (one NCCL rank each); torch.cuda.device_count() is {GPU_COUNT} here",
    )


cuda_args = functools.partial(toy_args, use_gpu=True)
"""``toy_args`` on the GPU: ``use_gpu=True`` makes a missing device an error instead of a CPU run."""


def cpu_args(directory: Any, checkpoints: Any = None, **overrides: Any) -> Any:
    """The same run on the CPU (the reference a GPU run is compared with)."""
    return toy_args(directory, checkpoints, **{**overrides, "use_gpu": False})
