"""FLOP accounting for ``benchmarks/gpu.py``: the training FLOPs of a GPT per token, the dense peak
of known GPUs per dtype, and model FLOPs utilisation (MFU). Pure functions: tested on the CPU.

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
"""A10G: NVIDIA publishes no datasheet (an AWS part); its figures are the ones commonly quoted (half an A10's
tensor rate). Pass ``--peak-tflops`` for a GPU not listed or a figure you trust more (clocks, power caps)."""

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
    """The dense peak in TFLOP/s that MFU is measured against: ``given`` (``--peak-tflops``) when set,
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
            raise ValueError(f"--peak-tflops {given!r} is invalid; allowed: a number of TFLOP/s > 0")
        return float(given)
    found = known_gpu(device_name)
    return None if found is None else found[1].get(dtype)


def gpt_matmul_parameters(layers: int, width: int, vocab: int, mlp_ratio: int = 4) -> int:
    """Weights that take part in matrix multiplies: per layer the attention's q, k, v and output
    projections (4 width^2) and the MLP (2 mlp_ratio width^2), plus the output head (width x vocab).
    Embeddings are looked up, not multiplied; norms and biases are negligible.

    Example:
        >>> gpt_matmul_parameters(layers=12, width=768, vocab=50304)  # GPT-2 small: 85M + the head
        123568128
    """
    return layers * (4 + 2 * mlp_ratio) * width * width + width * vocab


def gpt_flops_per_token(layers: int, width: int, sequence: int, vocab: int, mlp_ratio: int = 4) -> int:
    """Training FLOPs (forward and backward) per token of a GPT: 6 per matmul weight (2 forward,
    4 backward) and, per layer, 12 x sequence x width for the attention scores and their weighted
    sum (the full square, as PaLM's MFU counts it; causal masking does not halve it). Activation
    recomputation is not counted: this is model FLOPs, not hardware FLOPs.

    Example:
        >>> gpt_flops_per_token(layers=12, width=768, sequence=1024, vocab=50304)
        854654976
    """
    return 6 * gpt_matmul_parameters(layers, width, vocab, mlp_ratio) + 12 * layers * sequence * width


def mfu(tokens_per_second_per_gpu: float, flops_per_token: float, peak_tflops_per_gpu: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: the achieved FLOP/s of one GPU over its peak; None without a peak.

    Example:
        >>> round(mfu(400_000, 854_630_400, 989.4), 3)
        0.346
    """
    if not peak_tflops_per_gpu:
        return None
    return achieved_tflops(tokens_per_second_per_gpu, flops_per_token) / peak_tflops_per_gpu


def achieved_tflops(tokens_per_second_per_gpu: float, flops_per_token: float) -> float:
    """TFLOP/s one GPU achieves at that token rate.

    Example:
        >>> achieved_tflops(1e6, 2e8)
        200.0
    """
    return tokens_per_second_per_gpu * flops_per_token / 1e12
