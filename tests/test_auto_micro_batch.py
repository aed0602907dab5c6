"""gpu_batch_size_limit="auto": the micro-batch search (halving on torch.OutOfMemoryError), the
same weights as the limit given by hand, no search again on resume, 2 ddp ranks agreeing on the smallest."""

import os

import pytest
import torch
import torch.distributed as dist
from logs import captured_log

from distributed import run_ranks
from toy import ToyModule, flat_parameters, toy_args

from framework import Trainer, TrainerArguments
from framework.checkpoint.arguments import DefaultCheckpointerArguments


class LimitedMemory(ToyModule):
    """Runs out of "device memory" (raises torch.OutOfMemoryError) on a batch above ``fits``."""

    def __init__(self, fits: int, **kwargs) -> None:
        super().__init__(dropout=0.2, **kwargs)  # dropout: the probes must leave the RNG as it was
        self.fits = fits
        self.sizes_tried = []

    def train_step(self, global_step, batch, device):
        self.sizes_tried.append(len(batch[0]))
        if len(batch[0]) > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (a batch of {len(batch[0])})")
        return super().train_step(global_step, batch, device)


def test_auto_finds_the_largest_fitting_micro_batch_and_trains_as_the_limit_by_hand(tmp_path):
    common = dict(epochs=2, train_batch_size=32, log_level="INFO")
    by_hand = Trainer(LimitedMemory(fits=10), toy_args(tmp_path / "hand", gpu_batch_size_limit=8, **common))
    by_hand.train()

    module = LimitedMemory(fits=10)
    auto = Trainer(module, toy_args(tmp_path / "auto", gpu_batch_size_limit="auto", **common))
    with captured_log() as messages:
        auto.train()
    assert module.sizes_tried[:3] == [32, 16, 8]  # the probes: halving until one fits
    assert max(module.sizes_tried[3:]) == 8
    assert (auto.train_step_batch_size, auto.gradient_accumulation) == (8, 4)
    assert "gpu_batch_size_limit='auto': micro-batch 8, gradient accumulation 4 (the largest that fits)" in messages
    assert torch.allclose(flat_parameters(auto.module), flat_parameters(by_hand.module), atol=1e-6, rtol=0)
    assert auto.history.latest("train_loss") == pytest.approx(by_hand.history.latest("train_loss"), abs=1e-6)


def test_a_resumed_run_uses_the_micro_batch_in_its_checkpoint_and_resumes_exactly(tmp_path):
    args = dict(epochs=2, train_batch_size=32, gpu_batch_size_limit="auto")
    straight = Trainer(LimitedMemory(fits=10), toy_args(tmp_path / "straight", **args))
    straight.train()
    checkpoints = DefaultCheckpointerArguments(period=0, save_at_end=True, resume="auto")
    Trainer(LimitedMemory(fits=10), toy_args(tmp_path / "cut", checkpoints, max_steps=6, **args)).train()  # mid-epoch
    resumed_module = LimitedMemory(fits=10)
    resumed = Trainer(resumed_module, toy_args(tmp_path / "cut", checkpoints, **args))
    resumed.train()
    assert resumed.global_steps_finished == 16
    assert set(resumed_module.sizes_tried) == {8}  # no probe of 32 or 16: the checkpoint's micro-batch
    assert torch.allclose(flat_parameters(resumed.module), flat_parameters(straight.module), atol=1e-6, rtol=0)


def test_auto_refusals_name_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"gpu_batch_size_limit='big'.*'auto'"):
        TrainerArguments(gpu_batch_size_limit="big")
    manual = ToyModule()
    manual.automatic_optimization = False  # accumulation is the user's: the trainer cannot re-plan it
    with pytest.raises(ValueError, match=r"manual optimization.*gpu_batch_size_limit='auto'"):
        Trainer(manual, toy_args(tmp_path, gpu_batch_size_limit="auto"))


def test_nothing_fits_is_an_error_naming_auto(tmp_path):
    with pytest.raises(RuntimeError, match=r"gpu_batch_size_limit='auto': even a micro-batch of 1"):
        Trainer(LimitedMemory(fits=0), toy_args(tmp_path, gpu_batch_size_limit="auto")).train()


def _two_ranks(rank: int, out: str) -> dict:
    """On ddp: rank 1 fits less than rank 0; the auto run (also profiled) against the limit by hand."""
    dist.init_process_group("gloo")
    common = dict(epochs=1, train_batch_size=32, backend="ddp", log_every_n_steps=2)
    by_hand = Trainer(LimitedMemory(fits=10), toy_args(os.path.join(out, "hand"), gpu_batch_size_limit=8, **common))
    by_hand.train()
    module = LimitedMemory(fits=16 if rank == 0 else 10)
    auto = Trainer(module, toy_args(os.path.join(out, "auto"), gpu_batch_size_limit="auto", profiler="torch", **common))
    auto.train()
    return {
        "plan": (auto.train_step_batch_size, auto.gradient_accumulation),
        "equal": torch.allclose(flat_parameters(auto.module), flat_parameters(by_hand.module), atol=1e-6, rtol=0),
        "steps/s": auto.history.values("steps_per_second"),
        "traces": sorted(os.listdir(os.path.join(out, "auto", "run", "profiler"))) if rank == 0 else None,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_on_two_ddp_ranks_the_smallest_fit_wins_and_rank_zero_writes_the_trace(tmp_path):
    rank0, rank1 = run_ranks(_two_ranks, timeout=300, out=str(tmp_path))
    assert rank0["plan"] == rank1["plan"] == (8, 2)  # 16 per process: rank 0 fits 16, rank 1 only 8
    assert rank0["equal"] and rank1["equal"]
    assert len(rank0["steps/s"]) == len(rank1["steps/s"]) == 4  # 8 steps, logged every 2 (each rank its own clock)
    assert len(rank0["traces"]) == 1 and rank0["traces"][0].startswith("rank0")


def test_with_tbptt_the_probe_runs_one_chunk_and_the_run_equals_the_limit_by_hand(tmp_path):
    from test_loop_control import SequenceModule

    class LimitedSequence(SequenceModule):
        def train_step(self, global_step, batch, device, hiddens=None):
            if len(batch[0]) > 4:
                raise torch.OutOfMemoryError("out of memory")
            return super().train_step(global_step, batch, device, hiddens)

    common = dict(train_batch_size=16, tbptt_steps=5)
    by_hand = Trainer(LimitedSequence(), toy_args(tmp_path / "hand", gpu_batch_size_limit=4, **common))
    by_hand.train()
    module = LimitedSequence()
    auto = Trainer(module, toy_args(tmp_path / "auto", gpu_batch_size_limit="auto", **common))
    auto.train()
    assert module.seen[0] == (5, None)  # the probe that fit: the first chunk, no hidden state
    assert (auto.train_step_batch_size, auto.gradient_accumulation) == (4, 4)
    assert torch.allclose(flat_parameters(auto.module), flat_parameters(by_hand.module), atol=1e-6, rtol=0)
