"""Mixed precision (``sp-amp``, ``ddp-amp``) on CPU: bf16 autocast, and a GradScaler when forced."""

import os
import sys

import pytest
import torch

from distributed import run_ranks
from toy import ToyModule, flat_parameters

from backends import MixedPrecision, SingleProcess, TrainerBackend, build_backend
from framework import Trainer, TrainerArguments
from framework.callbacks import Callback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from digits import DigitsArguments, DigitsClassifier  # noqa: E402

ACCURACY_BAR = 0.95


class DtypeRecordingDigits(DigitsClassifier):
    """The digits example, noting the dtype the network computes in during train and val."""

    def __init__(self) -> None:
        super().__init__(DigitsArguments())
        self.dtypes = {}

    def train_step(self, global_step, batch, device):
        x, y = batch
        logits = self.net(x)
        self.dtypes["train"] = logits.dtype
        return torch.nn.functional.cross_entropy(logits, y)

    def val_step(self, global_step, batch, device):
        self.dtypes["val"] = self.net(batch[0]).dtype
        return super().val_step(global_step, batch, device)


def digits_args(backend: str, output_dir: str) -> TrainerArguments:
    return TrainerArguments(
        epochs=5,
        train_batch_size=64,
        backend=backend,
        seed=0,
        disable_tqdm=True,
        output_dir=output_dir,
        log_level="WARNING",
        checkpointer_args={"period": 0, "save_at_end": False},
    )


def train_digits(backend: str, output_dir: str, rank: int = 0) -> dict:
    module = DtypeRecordingDigits()
    trainer = Trainer(module, digits_args(backend, output_dir))
    history = trainer.train()
    return {
        "accuracy": history.latest("val_accuracy"),
        "dtypes": module.dtypes,
        "history": [(r["name"], r["value"]) for r in history.records],
        "world": trainer.backend.world_size,
    }


@pytest.mark.parametrize("backend, dtype", [("sp", torch.float32), ("sp-amp", torch.bfloat16)])
def test_single_process_backends_train_digits(backend, dtype, tmp_path):
    result = train_digits(backend, str(tmp_path))
    assert result["accuracy"] >= ACCURACY_BAR
    assert result["dtypes"] == {"train": dtype, "val": dtype}  # autocast covers train and val forwards


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_amp_trains_digits(tmp_path):
    rank0, rank1 = run_ranks(train_digits, timeout=90, backend="ddp-amp", output_dir=str(tmp_path))
    assert rank0["world"] == 2
    assert rank0["accuracy"] >= ACCURACY_BAR
    assert rank0["dtypes"] == {"train": torch.bfloat16, "val": torch.bfloat16}
    assert rank0["history"] == rank1["history"]


INF_STEP = 2


class InfAtStep(ToyModule):
    """Its loss is infinite at one step, so the scaler must skip that optimizer step."""

    def train_step(self, global_step, batch, device):
        loss = super().train_step(global_step, batch, device)
        return loss * float("inf") if global_step == INF_STEP else loss


class StepRecorder(Callback):
    """After every optimizer step: learning rate, parameters, scheduler position, scaler scale."""

    def __init__(self) -> None:
        self.steps = []
        self.state_at_start = None

    def on_begin_train(self, global_step):
        self.state_at_start = self.trainer.backend.state_dict()

    def on_end_optimizer_step(self, global_step):
        scheduler = self.trainer.schedulers[0]
        self.steps.append(
            {
                "lr": scheduler.get_last_lr()[0],
                "scheduler_position": scheduler.last_epoch,
                "params": flat_parameters(self.trainer.module),
                "scale": self.trainer.backend.precision.scaler.get_scale(),
            }
        )


def scaled_backend(use_gpu=None) -> TrainerBackend:
    return TrainerBackend(SingleProcess(use_gpu=use_gpu), MixedPrecision("bfloat16", use_grad_scaler=True))


def inf_args(tmp_path, **overrides) -> TrainerArguments:
    values = dict(
        epochs=1, train_batch_size=32, backend="sp-amp", disable_tqdm=True, log_level="WARNING", output_dir=str(tmp_path)
    )
    values.update(overrides)
    return TrainerArguments(**values)


def test_skipped_step_does_not_advance_the_scheduler_and_scaler_state_is_saved(tmp_path):
    recorder = StepRecorder()
    trainer = Trainer(InfAtStep(), inf_args(tmp_path), trainer_backend=scaled_backend(), callbacks=[recorder])
    initial = flat_parameters(trainer.module)
    trainer.train()
    steps = recorder.steps
    assert len(steps) == trainer.global_steps_finished == 8
    skipped, before = steps[INF_STEP], steps[INF_STEP - 1]
    # The inf step: parameters untouched, scheduler and learning rate held, scale halved.
    assert torch.equal(skipped["params"], before["params"])
    assert skipped["scheduler_position"] == before["scheduler_position"] == INF_STEP
    assert skipped["lr"] == before["lr"]
    assert (before["scale"], skipped["scale"]) == (65536.0, 32768.0)
    # Every other step moved the parameters and the scheduler.
    assert not torch.equal(steps[0]["params"], initial)
    assert [s["scheduler_position"] for s in steps] == [1, 2, 2, 3, 4, 5, 6, 7]
    # The scaler is part of the backend state, and a new backend restores it (before or after setup).
    state = trainer.backend.state_dict()
    assert state["precision"]["scaler"]["scale"] == 32768.0
    for restore_before_setup in (True, False):
        backend = scaled_backend(use_gpu=False)
        if restore_before_setup:
            backend.load_state_dict(state)
        backend.setup()
        if not restore_before_setup:
            backend.load_state_dict(state)
        assert backend.state_dict() == state


def test_scaler_state_survives_checkpoint_and_resume(tmp_path):
    first = Trainer(InfAtStep(scheduler="step"), inf_args(tmp_path), trainer_backend=scaled_backend())
    first.train()  # saves a checkpoint at the end
    saved = first.backend.state_dict()
    assert saved["precision"]["scaler"]["scale"] == 32768.0
    recorder = StepRecorder()
    resumed = Trainer(
        ToyModule(scheduler="step"),
        inf_args(tmp_path, epochs=2, checkpointer_args={"load_dir": str(tmp_path / "checkpoints")}),
        trainer_backend=scaled_backend(),
        callbacks=[recorder],
    )
    resumed.train()
    assert recorder.state_at_start == saved
    assert resumed.global_steps_finished == 16
    assert [s["scale"] for s in recorder.steps] == [32768.0] * 8


def test_gradients_are_unscaled_before_clipping(tmp_path):
    def grad_norms(precision: MixedPrecision) -> list:
        args = inf_args(
            tmp_path / str(precision.use_grad_scaler),
            clip_grads=True,
            max_grad_norm=0.5,
            track_grad_norm=True,
            log_every_n_steps=1,
        )
        trainer = Trainer(ToyModule(), args, trainer_backend=TrainerBackend(SingleProcess(), precision))
        history = trainer.train()
        return flat_parameters(trainer.module), [r["value"] for r in history.records if r["name"] == "grad_norm"]

    params_scaled, norms_scaled = grad_norms(MixedPrecision("bfloat16", use_grad_scaler=True))
    params_plain, norms_plain = grad_norms(MixedPrecision("bfloat16"))
    assert len(norms_scaled) == 8 and max(norms_plain) < 10  # true-sized norms, not 65536x
    assert norms_scaled == pytest.approx(norms_plain, rel=1e-5)
    torch.testing.assert_close(params_scaled, params_plain, rtol=1e-5, atol=1e-6)


def test_float16_on_cpu_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match=r"amp_dtype='float16' needs a CUDA device.*bfloat16"):
        Trainer(ToyModule(), TrainerArguments(backend="sp-amp", amp_dtype="float16", use_gpu=False))
    with pytest.raises(ValueError, match=r"dtype='fp16' is not supported; allowed: None, \['bfloat16', 'float16'\]"):
        MixedPrecision("fp16")


def test_amp_defaults_to_bfloat16_without_scaler_on_cpu():
    backend = build_backend("sp-amp", TrainerArguments(use_gpu=False))
    backend.setup()
    assert backend.precision.dtype == torch.bfloat16
    assert backend.precision.scaler is None
    assert backend.state_dict() == {"precision": {}}
