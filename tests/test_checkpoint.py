"""Checkpoint storage, triggers, retention, loading rules and async saves (real files, real trainers)."""

import logging
import os
import re
import threading
import time
from typing import Any, Dict, List, Optional

import pytest
import torch

from distributed import run_ranks
from toy import ToyModule, flat_parameters

from framework import Trainer, TrainerArguments
from framework.callbacks import Callback
from framework.checkpoint import Checkpoint, DefaultCheckpointer, DefaultCheckpointerArguments, storage
from framework.checkpoint.async_writer import BackgroundWriter
from framework.checkpoint.default import STALE_SUFFIX, checkpoint_name


class Opaque:
    """An arbitrary class: pickling an instance stores a reference to code."""

    def __init__(self) -> None:
        self.payload = [1, 2, 3]


class Recorder(Callback):
    """Remembers where training started and the optimizer state it started with."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.start: Dict[str, Any] = {}

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_begin_train(self, global_step: int) -> None:
        trainer = self.trainer
        self.start = {
            "global_step": global_step,
            "epochs_finished": trainer.epochs_finished,
            "batches_finished_in_epoch": trainer.batches_finished_in_epoch,
            "params": flat_parameters(trainer.module),
            "optimizer_state_len": len(trainer.optimizers[0].state),
        }


@pytest.fixture
def checkpoint_log() -> List[logging.LogRecord]:
    """Records of the checkpointer's logger (the framework's loggers do not propagate to pytest)."""
    records: List[logging.LogRecord] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("framework.checkpoint.default")
    handler, level = ListHandler(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def make_checkpoint(step: int, value: float = 0.0, metrics: Optional[Dict[str, float]] = None) -> Checkpoint:
    return Checkpoint(
        module_state={"model": {"w": torch.full((4,), value)}},
        trainer_state={"note": f"step {step}"},
        backend_state={},
        global_step=step,
        epoch=0,
        metrics=metrics or {},
    )


def trainer_args(tmp_path: Any, epochs: int = 2, **checkpointer: Any) -> TrainerArguments:
    return TrainerArguments(
        epochs=epochs,
        train_batch_size=32,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=str(tmp_path),
        checkpointer_args=DefaultCheckpointerArguments(**checkpointer),
    )


def names_in(directory: Any) -> List[str]:
    fs, path = storage.resolve(str(directory))
    return sorted(p.rsplit("/", 1)[-1] for p in storage.list_files(fs, path))


# -- storage ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_round_trip_local_and_memory(tmp_path, kind):
    directory = str(tmp_path / "ckpt") if kind == "local" else f"memory://roundtrip-{os.getpid()}/ckpt"
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory, resume="auto"))
    assert checkpointer.load() is None  # nothing there yet: start fresh
    written = make_checkpoint(7, value=1.5, metrics={"val_loss": 0.25})
    location = checkpointer.save(written, epoch=1, force=True)
    assert location == storage.join(directory, "checkpoint-000000007.pt")
    assert names_in(directory) == ["checkpoint-000000007.pt"]  # no temporary left behind
    loaded = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory, resume="auto")).load()
    assert loaded.global_step == 7 and loaded.metrics == {"val_loss": 0.25}
    assert torch.equal(loaded.module_state["model"]["w"], torch.full((4,), 1.5))
    assert loaded.trainer_state == {"note": "step 7"}


def test_damaged_bytes_are_detected_by_checksum(tmp_path):
    fs, path = storage.resolve(str(tmp_path / "state.pt"))
    storage.write_atomically(fs, path, {"w": torch.arange(10_000, dtype=torch.float32)})
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(16)  # inside the tensor data: torch.load alone would not notice
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    with pytest.raises(storage.CorruptCheckpoint, match="CRC"):
        storage.read(fs, path, weights_only=True)


def test_pickled_object_is_refused_with_opt_in_hint(tmp_path):
    bad = make_checkpoint(3).to_dict()
    bad["module"]["extra"] = Opaque()
    torch.save(bad, tmp_path / "checkpoint-000000003.pt")
    safe = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto"))
    with pytest.raises(storage.CheckpointRefused) as refused:
        safe.load()
    message = str(refused.value)
    assert "checkpoint-000000003.pt" in message and "checkpointer_args.weights_only=False" in message
    assert "Opaque" in message
    trusting = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto", weights_only=False))
    assert trusting.load().module_state["extra"].payload == [1, 2, 3]


def test_truncated_newest_is_reported_and_previous_used(tmp_path, checkpoint_log):
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto"))
    for step in (2, 4, 6):
        checkpointer.save(make_checkpoint(step, value=step), epoch=0, force=True)
    newest = tmp_path / checkpoint_name(6)
    newest.write_bytes(newest.read_bytes()[:100])
    loaded = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto")).load()
    assert loaded.global_step == 4
    warnings = [r.getMessage() for r in checkpoint_log if r.levelno == logging.WARNING]
    assert any(str(newest) in w and "truncated" in w for w in warnings), warnings


def test_directory_of_only_unreadable_checkpoints_is_an_error(tmp_path):
    (tmp_path / checkpoint_name(5)).write_bytes(b"not a checkpoint")
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto"))
    with pytest.raises(RuntimeError, match="none reads back"):
        checkpointer.load()


def test_missing_load_filename_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.pt")
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), load_filename=missing))
    with pytest.raises(FileNotFoundError, match=re.escape("nope.pt")):
        checkpointer.load()


# -- retention ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, best", [("min", {2, 6}), ("max", {1, 5})])
def test_keep_last_and_best_leave_exactly_expected_files(mode, best):
    directory = f"memory://retention-{mode}-{os.getpid()}"
    scores = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 2.0}
    args = DefaultCheckpointerArguments(save_dir=directory, keep_last_n=2, keep_best_n=2, metric="val_loss", mode=mode)
    checkpointer = DefaultCheckpointer(args)
    for step, score in scores.items():
        checkpointer.save(make_checkpoint(step, metrics={"val_loss": score}), epoch=step, force=True)
    expected = {5, 6} | best
    assert names_in(directory) == sorted(checkpoint_name(step) for step in expected)
    best_step = min(scores, key=scores.get) if mode == "min" else max(scores, key=scores.get)
    assert checkpointer.best_checkpoint() == storage.join(directory, checkpoint_name(best_step))


def test_unscored_checkpoints_are_never_best(tmp_path):
    args = DefaultCheckpointerArguments(save_dir=str(tmp_path), keep_last_n=1, keep_best_n=1)
    checkpointer = DefaultCheckpointer(args)
    checkpointer.save(make_checkpoint(10, metrics={"val_loss": 0.5}), epoch=1, force=True)  # validated
    for step in (13, 16):  # mid-epoch saves: no val_loss measured on these weights
        checkpointer.save(make_checkpoint(step, metrics={"train_loss": 0.1}), epoch=1, force=True)
    assert names_in(tmp_path) == [checkpoint_name(10), checkpoint_name(16)]


def test_checkpoints_of_an_abandoned_timeline_are_set_aside(tmp_path):
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto"))
    for step in (10, 20, 30):
        checkpointer.save(make_checkpoint(step), epoch=0, force=True)
    # A run resumed from step 10 writes step 15: 20 and 30 belong to the run it replaced.
    checkpointer.save(make_checkpoint(15), epoch=0, force=True)
    assert names_in(tmp_path) == sorted(
        [checkpoint_name(10), checkpoint_name(15), checkpoint_name(20) + STALE_SUFFIX, checkpoint_name(30) + STALE_SUFFIX]
    )
    assert DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto")).load().global_step == 15


# -- triggers, model export, resume rules (real trainers) ---------------------------------------
def test_save_triggers_and_model_export(tmp_path):
    class SaveOnDemand(Callback):
        def setup(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_end_optimizer_step(self, global_step: int) -> None:
            if global_step == 2:
                self.location = self.trainer.save_checkpoint()

    module = ToyModule(n_train=128, val_loaders=1)  # 4 steps per epoch at batch 32
    on_demand = SaveOnDemand()
    directory = tmp_path / "ckpt"
    args = trainer_args(tmp_path, epochs=5, save_dir=str(directory), period=2, save_every_n_steps=5, keep_last_n=None)
    trainer = Trainer(module, args, callbacks=[on_demand])
    trainer.train()
    steps_per_epoch = trainer.estimated_global_steps_per_epoch
    final = 5 * steps_per_epoch
    expected = {2}  # on demand
    expected |= {epoch * steps_per_epoch for epoch in range(2, 5, 2)}  # every 2 epochs (not the last)
    expected |= set(range(5, final + 1, 5))  # every 5 steps
    expected |= {final}  # at the end
    assert names_in(directory) == sorted(checkpoint_name(step) for step in expected)
    assert on_demand.location == str(directory / checkpoint_name(2))

    exported = trainer.save_model_checkpoint()
    assert exported == str(directory / f"model-{final:09d}.pt")
    weights = torch.load(exported, weights_only=True)["model"]
    for name, tensor in module.state_dict().items():
        assert torch.equal(weights[name], tensor)
    assert trainer.save_checkpoint() == str(directory / checkpoint_name(final))  # on demand after training


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = Recorder()
    trainer = Trainer(
        ToyModule(dropout=0.1, scheduler="step"), trainer_args(tmp_path, save_dir=directory, resume="auto"), callbacks=[first]
    )
    trainer.train()
    assert first.start["global_step"] == 0 and first.start["optimizer_state_len"] == 0
    finished_params, steps = flat_parameters(trainer.module), trainer.global_steps_finished

    again = Recorder()  # the same command again, asking for 3 epochs: continues after epoch 2
    args = trainer_args(tmp_path, epochs=3, save_dir=directory, load_dir=directory)
    trainer = Trainer(ToyModule(dropout=0.1, scheduler="step", seed=5), args, callbacks=[again])
    trainer.train()
    assert again.start["global_step"] == steps and again.start["epochs_finished"] == 2
    assert torch.equal(again.start["params"], finished_params)
    assert again.start["optimizer_state_len"] > 0  # momentum buffers restored
    assert trainer.global_steps_finished == steps * 3 // 2


def test_reset_optimizers_schedulers_loads_weights_only(tmp_path):
    source = str(tmp_path / "pretrain")
    trainer = Trainer(ToyModule(), trainer_args(tmp_path, save_dir=source))
    trainer.train()
    pretrained = flat_parameters(trainer.module)

    finetune = str(tmp_path / "finetune")
    recorder = Recorder()
    args = trainer_args(tmp_path, save_dir=finetune, load_dir=source, resume="auto", reset_optimizers_schedulers=True)
    trainer = Trainer(ToyModule(seed=3, scheduler="step"), args, callbacks=[recorder])
    trainer.train()
    assert torch.equal(recorder.start["params"], pretrained)
    assert recorder.start["global_step"] == 0 and recorder.start["optimizer_state_len"] == 0
    assert trainer.history.values("train_loss_epoch") and len(trainer.history.values("train_loss_epoch")) == 2

    # A restart of the fine-tuning run resumes itself in full (its own save_dir wins over load_dir).
    restart = Recorder()
    args = trainer_args(tmp_path, epochs=3, save_dir=finetune, load_dir=source, resume="auto", reset_optimizers_schedulers=True)
    Trainer(ToyModule(seed=3, scheduler="step"), args, callbacks=[restart]).train()
    assert restart.start["epochs_finished"] == 2 and restart.start["optimizer_state_len"] > 0


# -- asynchronous saves -------------------------------------------------------------------------
def test_async_save_copies_state_before_returning(tmp_path):
    args = DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto", async_save=True)
    checkpointer = DefaultCheckpointer(args)
    weights = torch.zeros(1000)
    checkpoint = Checkpoint({"model": {"w": weights}}, {}, {}, global_step=1)
    checkpointer.save(checkpoint, epoch=0, force=True)
    weights.add_(1.0)  # training goes on while the background thread writes
    checkpointer.wait()
    assert torch.equal(checkpointer.load().module_state["model"]["w"], torch.zeros(1000))


def test_background_writer_runs_one_save_at_a_time():
    writer = BackgroundWriter()
    events: List[str] = []
    release = threading.Event()

    def slow() -> None:
        events.append("first started")
        release.wait(5)
        events.append("first done")

    writer.submit(slow)
    submitter = threading.Thread(target=lambda: writer.submit(lambda: events.append("second started")))
    submitter.start()
    time.sleep(0.2)
    assert events == ["first started"]  # the second save waits for the first
    release.set()
    submitter.join(5)
    writer.wait()
    assert events == ["first started", "first done", "second started"]


def test_async_save_error_surfaces_on_next_save_and_at_the_end(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failing = str(blocker / "ckpt")
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=failing, async_save=True))
    checkpointer.save(make_checkpoint(1), epoch=0, force=True)  # returns: the write fails in the background
    with pytest.raises(RuntimeError, match="background checkpoint save failed") as raised:
        checkpointer.save(make_checkpoint(2), epoch=0, force=True)
    assert "a-file" in str(raised.value)
    checkpointer.save(make_checkpoint(3), epoch=0, force=True)
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        checkpointer.wait()  # the end of training reports the last one

    trainer = Trainer(ToyModule(), trainer_args(tmp_path, save_dir=failing, async_save=True, period=1))
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        trainer.train()


# -- ddp <-> sp -------------------------------------------------------------------------------
def _ddp_train(rank: int, directory: str, load_filename: Optional[str] = None, epochs: int = 1) -> Dict[str, Any]:
    """Runs in each of 2 gloo ranks."""
    recorder = Recorder()
    args = TrainerArguments(
        epochs=epochs,
        train_batch_size=32,
        backend="ddp",
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=os.path.join(directory, "out"),
        checkpointer_args=DefaultCheckpointerArguments(
            save_dir=os.path.join(directory, "ddp"), save_every_n_steps=3, load_filename=load_filename, keep_last_n=None
        ),
    )
    trainer = Trainer(ToyModule(dropout=0.1, scheduler="step", seed=11), args, callbacks=[recorder])
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"start": recorder.start, "params": flat_parameters(trainer.module), "step": trainer.global_steps_finished}


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_checkpoint_loads_into_sp_and_back(tmp_path):
    directory = str(tmp_path)
    # sp writes a checkpoint after one epoch and another mid-epoch.
    sp_dir = os.path.join(directory, "sp")
    args = trainer_args(tmp_path / "out-sp", epochs=1, save_dir=sp_dir, save_every_n_steps=3)
    trainer = Trainer(ToyModule(dropout=0.1, scheduler="step", seed=11), args)
    trainer.train()
    sp_params = flat_parameters(trainer.module)
    sp_steps = trainer.global_steps_finished

    # ddp resumes the sp checkpoint, trains a second epoch and writes its own checkpoints.
    ranks = run_ranks(_ddp_train, directory=directory, load_filename=os.path.join(sp_dir, checkpoint_name(sp_steps)), epochs=2)
    for outcome in ranks:
        assert torch.equal(outcome["start"]["params"], sp_params)
        assert outcome["start"]["epochs_finished"] == 1 and outcome["start"]["optimizer_state_len"] > 0
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    ddp_steps = ranks[0]["step"]
    assert ddp_steps == 2 * sp_steps

    # sp resumes the ddp-written final checkpoint (and a mid-epoch one, at the same sample position).
    ddp_dir = os.path.join(directory, "ddp")
    recorder = Recorder()
    args = trainer_args(
        tmp_path / "out-sp2",
        epochs=3,
        save_dir=os.path.join(directory, "sp2"),
        load_filename=os.path.join(ddp_dir, checkpoint_name(ddp_steps)),
    )
    Trainer(ToyModule(seed=1, scheduler="step"), args, callbacks=[recorder]).train()
    assert torch.equal(recorder.start["params"], ranks[0]["params"]) and recorder.start["epochs_finished"] == 2

    mid = next(step for step in range(sp_steps + 1, ddp_steps) if step % 3 == 0)
    recorder = Recorder()
    args = trainer_args(
        tmp_path / "out-sp3", save_dir=os.path.join(directory, "sp3"), load_filename=os.path.join(ddp_dir, checkpoint_name(mid))
    )
    Trainer(ToyModule(seed=1, scheduler="step"), args, callbacks=[recorder]).train()
    # ddp: 16 samples per rank per micro-batch; sp: 32 per micro-batch; same samples consumed.
    assert recorder.start["batches_finished_in_epoch"] == (mid - sp_steps)


class LogsValidationCopy(ToyModule):
    """Also logs ``val_copy``: the validation loss again (a metric the run may rank by)."""

    def val_step(self, global_step, batch, device):
        losses, correct = super().val_step(global_step, batch, device)
        self.log("val_copy", losses.mean())
        return losses, correct


@pytest.mark.parametrize("metric", ["val_los", "val_acc_epoch"])
def test_a_misspelt_checkpoint_metric_is_named_at_the_first_validation(tmp_path, metric):
    from toy import toy_args

    checkpoints = DefaultCheckpointerArguments(period=1, keep_last_n=1, keep_best_n=1, metric=metric)
    trainer = Trainer(ToyModule(n_train=64, scheduler=None), toy_args(tmp_path, checkpoints, epochs=3))
    with pytest.raises(ValueError, match=rf"metric={metric!r} is not recorded: the validation at step 2 recorded \['val_loss'\]"):
        trainer.train()
    assert trainer.global_steps_finished == 2  # stopped at the first validation
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / checkpoint_name(2))  # nothing kept that could not be ranked


def test_load_weights_best_ranks_by_the_runs_own_metric_and_mode(tmp_path):
    from toy import toy_args

    from framework.checkpoint import load_weights

    checkpoints = DefaultCheckpointerArguments(period=1, keep_last_n=None, metric="val_copy", mode="max")
    trainer = Trainer(LogsValidationCopy(n_train=64, scheduler=None), toy_args(tmp_path, checkpoints, epochs=4))
    trainer.train()
    copies = {record["step"]: record["value"] for record in trainer.history.records if record["name"] == "val_copy"}
    losses = {record["step"]: record["value"] for record in trainer.history.records if record["name"] == "val_loss"}
    run_best, val_loss_best = max(copies, key=copies.__getitem__), min(losses, key=losses.__getitem__)
    assert run_best != val_loss_best  # the two rankings disagree: the test tells them apart
    url = load_weights(ToyModule(n_train=64, scheduler=None), str(tmp_path / "run" / "checkpoints"), step="best")
    assert url.endswith(checkpoint_name(run_best))
    assert trainer.validate(checkpoint="best")["val_copy"] == pytest.approx(copies[run_best])
