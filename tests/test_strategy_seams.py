"""Where features meet the strategy: EMA, evaluation from checkpoints, the automatic micro-batch
and prediction on ``sp``, 2-rank ``ddp`` and 2-rank ``fsdp`` (issue 31).

Every backend runs the same scenarios (``scenarios``): ``sp`` in the test process (its tests are
in the quick loop), ``ddp`` and ``fsdp`` in a 2-rank process group each. The model keeps a
rotary-style float buffer of more than one element (whole on every rank, beside the sharded
parameters), validation runs after every step with an EMA swapped in, and checks compare each
backend with itself (bitwise) and with ``sp`` (fp32 summation order: 1e-5).
"""

import glob
import os
import signal
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from distributed import run_ranks
from tiny_transformer import TinyTransformer

from framework import Trainer, TrainerArguments
from framework.callbacks import EMA, Callback
from framework.lifecycle.preemption import TrainingPreempted

TWO_RANKS = [pytest.mark.distributed, pytest.mark.slow]
BACKENDS = [pytest.param("sp"), pytest.param("ddp", marks=TWO_RANKS), pytest.param("fsdp", marks=TWO_RANKS)]
SUMMATION_TOLERANCE = 1e-5  # another world size sums the same gradients in another order


class RotaryTransformer(TinyTransformer):
    """The tiny transformer with a float cos table buffer (as rotary embeddings keep) and a predict loader."""

    def __init__(self) -> None:
        super().__init__()
        angles = torch.arange(8 * 16, dtype=torch.float32).view(8, 16) / 7
        self.register_buffer("cos_cache", torch.cos(angles))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.cos_cache[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def get_predict_dataloader(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def predict_step(self, global_step, batch, device):
        return self(batch[0])


class SignalAtStep(Callback):
    """SIGUSR1 to rank zero's own process after optimizer step ``step`` (a preemption)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_end_optimizer_step(self, global_step):
        if global_step == self.step and self.trainer.is_main_process:
            os.kill(os.getpid(), signal.SIGUSR1)


def arguments(backend: str, out: str, save_every: int, **overrides) -> TrainerArguments:
    """2 epochs of 4 steps (global batch 16), validation after every step, a checkpoint every ``save_every`` steps."""
    args = TrainerArguments(
        epochs=2,
        train_batch_size=16,
        backend=backend,
        disable_tqdm=True,
        log_level="ERROR",
        output_dir=out,
        sanity_val_steps=0,
        val_every_n_steps=1,
        **overrides,
    )
    checkpoints = args.checkpointer_args
    checkpoints.save_dir, checkpoints.period, checkpoints.save_every_n_steps = os.path.join(out, "checkpoints"), 0, save_every
    checkpoints.save_at_end, checkpoints.keep_last_n = False, None
    return args


def full(trainer: Trainer) -> torch.Tensor:
    state = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return torch.cat([tensor.detach().float().reshape(-1).cpu() for tensor in state.values()])


def val_losses(trainer: Trainer) -> dict:
    return {record["step"]: record["value"] for record in trainer.history.records if record["name"] == "val_loss"}


def outcome(call: Callable[[], Any]) -> Any:
    """``call()``, or what it raised (on every rank alike: the checks name it)."""
    try:
        return call()
    except Exception as error:
        return f"raised {type(error).__name__}: {error}"


def scenarios(backend: str, out: str) -> dict:
    """Every scenario on ``backend`` (in the process group, if any, that the caller made)."""
    results = {}
    directory = os.path.join(out, backend)

    # The same training, saved every 4 steps and every 5 (the last validation is not followed by a save).
    every_4 = Trainer(RotaryTransformer(), arguments(backend, os.path.join(directory, "every-4"), 4), callbacks=[EMA(0.9)])
    every_4.train()
    results["every 4"] = full(every_4)
    results["val losses"] = val_losses(every_4)
    every_5 = Trainer(RotaryTransformer(), arguments(backend, os.path.join(directory, "every-5"), 5), callbacks=[EMA(0.9)])
    every_5.train()
    results["every 5"] = full(every_5)

    # Evaluation after training: the current weights, then checkpoints' (each with its own average).
    (step_4,) = glob.glob(os.path.join(directory, "every-4", "checkpoints", "checkpoint-000000004*"))
    results["validate"] = outcome(lambda: every_5.validate()["val_loss"])
    results["validate best"] = outcome(lambda: every_5.validate(checkpoint="best")["val_loss"])  # step 5: the only one kept
    results["validate step 4"] = outcome(lambda: every_5.validate(checkpoint=step_4)["val_loss"])
    results["predict last"] = outcome(lambda: every_5.predict(checkpoint="last"))
    results["predict again"] = outcome(every_5.predict)

    # Preempted by SIGUSR1 after step 3, resumed from the checkpoint written there.
    preempted = arguments(backend, os.path.join(directory, "preempted"), 5)
    try:
        Trainer(RotaryTransformer(), preempted, callbacks=[EMA(0.9), SignalAtStep(3)]).train()
        results["preempted at"] = None
    except TrainingPreempted as stop:
        results["preempted at"] = stop.global_step
    preempted.checkpointer_args.resume = "auto"
    resumed = Trainer(RotaryTransformer(), preempted, callbacks=[EMA(0.9)])
    resumed.train()
    results["resumed"] = full(resumed)

    # The automatic micro-batch (nothing runs out of memory: the per-process batch) against the same run.
    automatic = Trainer(
        RotaryTransformer(),
        arguments(backend, os.path.join(directory, "auto"), 4, gpu_batch_size_limit="auto"),
        callbacks=[EMA(0.9)],
    )
    automatic.train()
    results["auto"], results["auto micro-batch"] = full(automatic), automatic.train_step_batch_size
    return results


def two_rank_scenarios(rank: int, out: str) -> dict:
    """ddp's scenarios, then fsdp's, in one process group: the second backend's preemption must not
    read the first's counts in the group's store (it hung there before)."""
    dist.init_process_group("gloo")
    results = {backend: scenarios(backend, out) for backend in ("ddp", "fsdp")}
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    return scenarios("sp", str(tmp_path_factory.mktemp("seams-sp")))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return run_ranks(two_rank_scenarios, out=str(tmp_path_factory.mktemp("seams-2-ranks")), timeout=900)[0]


@pytest.fixture(scope="module")
def ddp_run(two_rank_runs):
    return two_rank_runs["ddp"]


@pytest.fixture(scope="module")
def fsdp_run(two_rank_runs):
    return two_rank_runs["fsdp"]


@pytest.fixture
def runs(request, backend, sp_run):
    """``{"sp": ..., backend: ...}``: this backend's results beside sp's."""
    return {"sp": sp_run, backend: request.getfixturevalue(f"{backend}_run")}


def max_difference(first: torch.Tensor, second: torch.Tensor) -> float:
    return (first - second).abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ema_training_does_not_depend_on_the_checkpoint_schedule_or_a_preemption(runs, backend):
    run = runs[backend]
    assert max_difference(run["every 4"], run["every 5"]) == 0, "training after an EMA validation used stale weights"
    assert run["preempted at"] in (3, 4)  # ddp agrees on the signal at the next step boundary
    assert max_difference(run["resumed"], run["every 5"]) == 0, "a run preempted by SIGUSR1 resumed off course"
    assert max_difference(run["every 4"], runs["sp"]["every 4"]) <= SUMMATION_TOLERANCE  # the float buffer averaged too


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_after_training_and_from_checkpoints_evaluates_their_own_average(runs, backend):
    run = runs[backend]
    for name in ("validate", "validate best", "validate step 4"):
        assert isinstance(run[name], float), f"{name}: {run[name]}"
    recorded = run["val losses"]  # every step's validation during training (every-4 and every-5 train alike)
    assert sorted(recorded) == list(range(1, 9))
    assert run["validate"] == pytest.approx(recorded[8], rel=1e-6)
    assert run["validate best"] == pytest.approx(recorded[5], rel=1e-6)
    assert run["validate step 4"] == pytest.approx(recorded[4], rel=1e-6)
    assert abs(recorded[5] - recorded[8]) > 1e-3  # a checkpoint's average differs from the final one
    assert run["validate"] == pytest.approx(runs["sp"]["validate"], abs=SUMMATION_TOLERANCE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_automatic_micro_batch_trains_the_weights_of_the_same_micro_batch_by_hand(runs, backend):
    run = runs[backend]
    assert run["auto micro-batch"] == (16 if backend == "sp" else 8)  # the per-process batch: nothing ran out of memory
    assert max_difference(run["auto"], run["every 4"]) == 0, "the probes' gradients reached the first step"


@pytest.mark.parametrize("backend", BACKENDS)
def test_predict_from_the_last_checkpoint_and_again_after_it(runs, backend):
    run, expected = runs[backend], runs["sp"]["predict last"]
    for name in ("predict last", "predict again"):
        assert isinstance(run[name], torch.Tensor), f"{name}: {run[name]}"
    assert run["predict last"].shape == expected.shape == (31, 8, 32)
    assert max_difference(run["predict last"], expected) <= SUMMATION_TOLERANCE
    assert torch.equal(run["predict again"], run["predict last"])  # the loaded weights stay
