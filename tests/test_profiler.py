"""profiler="throughput"/"torch": throughput metrics at log points, torch.profiler traces under
<output_dir>/profiler/, and the argument's validation."""

import csv
import glob
import json
import os

import pytest

from toy import ToyModule, toy_args

from framework import Trainer, TrainerArguments
from framework.callbacks import Throughput, TorchProfiler


class CountedFlops(ToyModule):
    """Declares its training FLOPs per sample (6 x parameters, the usual dense estimate)."""

    @property
    def flops_per_sample(self) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def read_metrics(output_dir: str) -> "dict[str, list[tuple[int, float]]]":
    metrics: dict[str, list[tuple[int, float]]] = {}
    with open(os.path.join(output_dir, "metrics.csv")) as handle:
        for row in csv.DictReader(handle):
            metrics.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    return metrics


def test_torch_profiler_writes_a_trace_and_throughput_reaches_metrics_csv(tmp_path):
    args = toy_args(tmp_path, profiler="torch", train_batch_size=32, log_every_n_steps=2)  # 8 steps
    module = CountedFlops()
    trainer = Trainer(module, args, callbacks=[Throughput(peak_flops=1e12)])  # replaces the default one
    assert [type(c).__name__ for c in trainer.callbacks].count("Throughput") == 1
    assert any(isinstance(c, TorchProfiler) for c in trainer.callbacks)
    trainer.train()

    traces = glob.glob(os.path.join(args.output_dir, "profiler", "rank0*.pt.trace.json"))
    assert len(traces) == 1, os.listdir(os.path.join(args.output_dir, "profiler"))
    with open(traces[0]) as handle:
        events = json.load(handle)["traceEvents"]
    assert any("ProfilerStep" in str(event.get("name")) for event in events)  # the recorded steps
    assert any("addmm" in str(event.get("name")) for event in events)  # the model's operators

    metrics = read_metrics(args.output_dir)
    assert [step for step, _ in metrics["samples_per_second"]] == [2, 4, 6, 8]
    for (_, samples), (_, steps), (_, mfu) in zip(metrics["samples_per_second"], metrics["steps_per_second"], metrics["mfu"]):
        assert samples > 0 and samples == pytest.approx(32 * steps, rel=1e-6)
        assert mfu == pytest.approx(samples * module.flops_per_sample / 1e12, rel=1e-6)
    assert "peak_memory_gib" not in metrics  # CUDA only


def test_throughput_alone_writes_no_trace_and_off_adds_nothing(tmp_path):
    args = toy_args(tmp_path, profiler="throughput", log_every_n_steps=4)
    trainer = Trainer(ToyModule(), args)
    trainer.train()
    assert not os.path.exists(os.path.join(args.output_dir, "profiler"))
    metrics = read_metrics(args.output_dir)
    assert [step for step, _ in metrics["steps_per_second"]] == [4, 8]
    assert "mfu" not in metrics  # the module declares no flops_per_sample
    off = Trainer(ToyModule(), toy_args(tmp_path / "off"))
    assert not any(isinstance(c, (Throughput, TorchProfiler)) for c in off.callbacks)


def test_invalid_profiler_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"profiler='nsys'.*'off', 'throughput', 'torch'"):
        TrainerArguments(profiler="nsys")
    with pytest.raises(ValueError, match=r"TorchProfiler\(active=0\)"):
        TorchProfiler(active=0)
    with pytest.raises(ValueError, match=r"Throughput\(peak_flops=0\)"):
        Throughput(peak_flops=0)
