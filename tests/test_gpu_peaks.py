"""``framework/callbacks/gpu_peaks.py``: the dense peaks MFU is measured against (read by the
``Throughput`` callback's ``known_peak_flops`` and by ``benchmarks/gpu.py``)."""

import pytest
import torch

from framework.callbacks import throughput
from framework.callbacks.gpu_peaks import known_gpu, peak_tflops


@pytest.mark.parametrize(
    "device_name, label",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla T4", "T4"),
    ],
)
def test_each_known_gpu_is_told_apart_from_its_neighbours(device_name, label):
    assert known_gpu(device_name)[0] == label


def test_peaks_by_dtype_and_the_refusals():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4 and peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5 and peak_tflops("NVIDIA L4", "tf32") == 60.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert known_gpu("AMD Instinct MI300X") is None and peak_tflops("AMD Instinct MI300X", "bf16", given=1307.0) == 1307.0
    with pytest.raises(ValueError, match=r"dtype='int8' is not known; allowed: fp32, tf32, bf16, fp16"):
        peak_tflops("NVIDIA H100", "int8")
    with pytest.raises(ValueError, match=r"a peak of -1.0 TFLOP/s is invalid; allowed: a number > 0"):
        peak_tflops("NVIDIA H100", "bf16", given=-1.0)


def test_the_throughput_callback_reads_the_table_and_your_own_entries_first(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert throughput.known_peak_flops(cuda) == 756e12  # not the SXM part's 989
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    assert throughput.known_peak_flops(cuda) == 125e12  # fp16 where there is no bf16
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "My Accelerator 9000")
    assert throughput.known_peak_flops(cuda) is None
    monkeypatch.setitem(throughput.KNOWN_PEAK_FLOPS, "Accelerator 9000", 5e14)
    assert throughput.known_peak_flops(cuda) == 5e14
