"""FLOP accounting for ``benchmarks/gpu.py``: the training FLOPs of a GPT per token and model FLOPs
utilisation (MFU). Pure functions: tested on the CPU. The dense peaks of known GPUs per dtype are the
framework's table (``framework/callbacks/gpu_peaks.py``, also read by the ``Throughput`` callback),
re-exported here.
"""

from typing import Optional

from framework.callbacks.gpu_peaks import DTYPES, KNOWN_GPUS, known_gpu, peak_tflops

__all__ = [
    "DTYPES",
    "KNOWN_GPUS",
    "achieved_tflops",
    "gpt_flops_per_token",
    "gpt_matmul_parameters",
    "known_gpu",
    "mfu",
    "peak_tflops",
]


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
