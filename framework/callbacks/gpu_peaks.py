"""Dense peak FLOP/s of known GPUs, per dtype: what model FLOPs utilisation (MFU) is measured against
(the ``Throughput`` callback, ``benchmarks/gpu.py``).

Peaks are the vendors' dense (no 2:4 sparsity) figures per GPU, in TFLOP/s. ``fp32`` is the CUDA
cores' rate (what fp32 matmuls get with torch's default ``allow_tf32=False``), ``tf32`` the tensor
cores' rate for fp32 inputs when TF32 is allowed, ``bf16``/``fp16`` the tensor cores' rate with fp32
accumulation (what ``torch.autocast`` and bf16 weights get). GeForce cards accumulate in fp32 at
half their fp16-accumulate rate; that half is the figure given.
"""

import re
from typing import Dict, List, Optional, Tuple

# (pattern matched against torch.cuda.get_device_name(), label, {dtype: dense TFLOP/s}); first match wins,
# so more specific names come first ("H100 PCIe" before the SXM part, "A10G" and "L40S" before "A10", "L4").
KNOWN_GPUS: List[Tuple[str, str, Dict[str, float]]] = [
    (r"H200 NVL", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    (r"H200", "H200 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H100 PCIe", "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100 NVL", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    (r"H100|GH200", "H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"A10G", "A10G", {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0}),
    (r"\bA10\b", "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"RTX 4090", "RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 3090", "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"V100", "V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", "T4", {"fp32": 8.1, "fp16": 65.0}),
]
"""Matched against ``torch.cuda.get_device_name()``. A10G: NVIDIA publishes no datasheet (an AWS part); its
figures are the ones commonly quoted (half an A10's tensor rate). Pass your own peak (``Throughput(peak_flops=)``,
``benchmarks/gpu.py --peak-tflops``) for a GPU not listed or a figure you trust more (clocks, power caps)."""

DTYPES = ("fp32", "tf32", "bf16", "fp16")


def known_gpu(device_name: str) -> Optional[Tuple[str, Dict[str, float]]]:
    """The label and dense peaks (TFLOP/s by dtype) of the GPU named ``device_name``, or None.

    Example:
        >>> known_gpu("NVIDIA H100 80GB HBM3")[0], known_gpu("NVIDIA H100 PCIe")[0], known_gpu("NVIDIA L40S")[0]
        ('H100 SXM', 'H100 PCIe', 'L40S')
        >>> known_gpu("NVIDIA A10G")[0], known_gpu("NVIDIA A100-SXM4-80GB")[0], known_gpu("Radeon") is None
        ('A10G', 'A100', True)
    """
    for pattern, label, peaks in KNOWN_GPUS:
        if re.search(pattern, device_name):
            return label, peaks
    return None


def peak_tflops(device_name: str, dtype: str, given: Optional[float] = None) -> Optional[float]:
    """The dense peak in TFLOP/s that MFU is measured against: ``given`` (e.g. a ``--peak-tflops`` flag) when set,
    else the table's figure for ``dtype`` on this GPU; None when neither is known.

    Raises:
        ValueError: ``dtype`` is not one of ``DTYPES``, or ``given`` is not a positive number.

    Example:
        >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), peak_tflops("NVIDIA L4", "fp32")
        (989.4, 30.3)
        >>> peak_tflops("Some GPU", "bf16"), peak_tflops("Some GPU", "bf16", given=100.0)
        (None, 100.0)
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not known; allowed: {', '.join(DTYPES)}")
    if given is not None:
        if not given > 0:
            raise ValueError(f"a peak of {given!r} TFLOP/s is invalid; allowed: a number > 0")
        return float(given)
    found = known_gpu(device_name)
    return None if found is None else found[1].get(dtype)
