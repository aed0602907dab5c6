"""Never lose a run: one run per directory, non-finite values, hostile files and failing storage.

Everything here uses real files, real trainers and real (crafted) pickles; failing storage is
a real fsspec filesystem registered under the ``faultyfs`` protocol that raises OS errors.
"""

import csv
import errno
import io
import logging
import os
import random as random_module
import re
import struct
import zipfile
from typing import Any, ClassVar, Dict, List, Optional

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from distributed import run_ranks
from toy import ToyModule

from framework import Trainer, TrainerArguments, TrainingDiverged
from framework.callbacks import Callback
from framework.checkpoint import (
    Checkpoint,
    CheckpointRefused,
    CheckpointWriteError,
    DefaultCheckpointer,
    DefaultCheckpointerArguments,
    RunDirectoryInUse,
    storage,
)
from framework.checkpoint.default import STALE_SUFFIX, checkpoint_name
from framework.run.run_directory import check_output_dir_free

STEPS_PER_EPOCH = 4  # ToyModule(n_train=128) at batch 32


# -- helpers ---------------------------------------------------------------------------------
class StepCounter(Callback):
    """Counts the optimizer steps a run took (0 when it was refused at setup)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_end_optimizer_step(self, global_step: int) -> None:
        self.steps += 1


def run_args(
    output_dir: Any, epochs: int = 2, stop_on_nonfinite_loss: bool = True, in_use: str = "error", **checkpointer: Any
) -> TrainerArguments:
    return TrainerArguments(
        epochs=epochs,
        train_batch_size=32,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=str(output_dir),
        output_dir_in_use=in_use,
        stop_on_nonfinite_loss=stop_on_nonfinite_loss,
        checkpointer_args=DefaultCheckpointerArguments(**checkpointer),
    )


def train(
    output_dir: Any,
    epochs: int = 2,
    callbacks: tuple = (),
    stop_on_nonfinite_loss: bool = True,
    in_use: str = "error",
    **checkpointer: Any,
) -> Trainer:
    arguments = run_args(output_dir, epochs, stop_on_nonfinite_loss, in_use, **checkpointer)
    trainer = Trainer(ToyModule(n_train=128, scheduler="step"), arguments, callbacks=callbacks)
    trainer.train()
    return trainer


def snapshot(directory: Any) -> Dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, directory)] = handle.read()
    return files


def make_checkpoint(step: int, value: float = 0.0, metrics: Optional[Dict[str, float]] = None) -> Checkpoint:
    return Checkpoint({"model": {"w": torch.full((4,), value)}}, {}, {}, global_step=step, metrics=metrics or {})


def names_in(directory: str) -> List[str]:
    fs, path = storage.resolve(directory)
    return sorted(p.rsplit("/", 1)[-1] for p in storage.list_files(fs, path))


@pytest.fixture
def checkpoint_log() -> List[logging.LogRecord]:
    """Records of the checkpointer's loggers (the framework's loggers do not propagate to pytest)."""
    records: List[logging.LogRecord] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    loggers = [logging.getLogger("framework.checkpoint.default"), logging.getLogger("framework.checkpoint.storage")]
    handler, levels = ListHandler(level=logging.INFO), [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield records
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- 2. a new run never destroys an old one ---------------------------------------------------
def test_rerun_without_resume_is_refused_before_step_one_and_leaves_every_file(tmp_path):
    out = tmp_path / "run"
    train(out)
    before = snapshot(out)
    assert "metrics.csv" in before and f"checkpoints/{checkpoint_name(2 * STEPS_PER_EPOCH)}" in before

    counter = StepCounter()
    again = Trainer(ToyModule(n_train=128, scheduler="step"), run_args(out), callbacks=[counter])
    with pytest.raises(RunDirectoryInUse) as refused:
        again.train()
    message = str(refused.value)
    assert str(out) in message and "metrics.csv" in message
    assert "--checkpointer.resume auto" in message and "another output_dir" in message
    assert counter.steps == 0
    assert snapshot(out) == before  # nothing overwritten, truncated, renamed or removed

    resumed = StepCounter()  # the first way on: resume it
    trainer = train(out, epochs=3, callbacks=(resumed,), resume="auto")
    assert resumed.steps == STEPS_PER_EPOCH and trainer.global_steps_finished == 3 * STEPS_PER_EPOCH
    other = StepCounter()  # the second way on: another output_dir
    train(tmp_path / "run2", epochs=1, callbacks=(other,))
    assert other.steps == STEPS_PER_EPOCH


def test_a_rerun_by_default_trains_in_a_new_version_directory_and_says_so_once(tmp_path, framework_log):
    out = tmp_path / "run"
    train(out, epochs=1, in_use="new_version")
    before = snapshot(out)
    second = train(out, epochs=1, in_use="new_version")
    third = train(out, epochs=1, in_use="new_version")
    assert second.args.output_dir == str(out / "version_1") and third.args.output_dir == str(out / "version_2")
    for version in ("version_1", "version_2"):
        assert {"metrics.csv", "config.yaml", f"checkpoints/{checkpoint_name(STEPS_PER_EPOCH)}"} <= set(snapshot(out / version))
    assert {name: data for name, data in snapshot(out).items() if not name.startswith("version_")} == before
    said = [message for message in framework_log if "holds another run: this run writes to" in message]
    assert said == [
        f"output_dir {out} holds another run: this run writes to {out / version} (--checkpointer.resume auto continues "
        "the run there instead; --trainer.output_dir_in_use error refuses)"
        for version in ("version_1", "version_2")
    ]
    resumed = train(out, epochs=2, in_use="new_version", resume="auto")  # resume: the run in output_dir itself
    assert resumed.args.output_dir == str(out) and resumed.global_steps_finished == 2 * STEPS_PER_EPOCH
    with pytest.raises(ValueError, match=r"output_dir_in_use='ask' is invalid; allowed: one of \('new_version', 'error'\)"):
        run_args(out, in_use="ask")


def test_validate_before_train_keeps_one_run_in_one_directory(tmp_path, framework_log):
    # The HF habit: trainer.evaluate() (here validate()) before trainer.train(). Fault: train() took the
    # metrics.csv its own validate() wrote for another run's (mutant: RunClaim.move_if_taken ignores
    # evaluated_first -> "holds another run" and version_1; mutant: claim_directory without own_files ->
    # RunDirectoryInUse under output_dir_in_use="error").
    for in_use in ("new_version", "error"):
        out = tmp_path / in_use
        trainer = Trainer(ToyModule(n_train=128, scheduler="step"), run_args(out, epochs=1, in_use=in_use))
        before = trainer.validate()
        trainer.train()
        assert trainer.args.output_dir == str(out) and not (out / "version_1").exists()
        with open(out / "metrics.csv", newline="") as handle:
            rows = [(int(row["step"]), row["name"]) for row in csv.DictReader(handle)]
        assert (0, "val_loss") in rows and (STEPS_PER_EPOCH, "val_loss") in rows  # the evaluation and the training
        assert trainer.history.values("val_loss")[0] == before["val_loss"]
    assert not [message for message in framework_log if "holds another run" in message]
    # Another run's directory still sends a new run (evaluated first or not) to version_1.
    second = Trainer(ToyModule(n_train=128, scheduler="step"), run_args(tmp_path / "new_version", epochs=1, in_use="new_version"))
    second.train()
    assert second.args.output_dir == str(tmp_path / "new_version" / "version_1")


def test_explicit_save_dir_of_another_run_is_refused(tmp_path):
    shared = str(tmp_path / "shared-checkpoints")
    train(tmp_path / "a", epochs=1, save_dir=shared)
    before = snapshot(shared)
    with pytest.raises(RunDirectoryInUse) as refused:
        train(tmp_path / "b", epochs=1, save_dir=shared)  # fresh output_dir, same save_dir
    message = str(refused.value)
    assert shared in message and checkpoint_name(STEPS_PER_EPOCH) in message
    assert "--checkpointer.resume auto" in message and "another save_dir (--checkpointer.save_dir)" in message
    assert snapshot(shared) == before
    assert not os.path.exists(tmp_path / "b" / "metrics.csv")  # refused before anything was written


def test_loading_from_its_own_save_dir_continues_the_run(tmp_path):
    directory = str(tmp_path / "ckpt")
    writer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory))
    for step in (10, 20):
        writer.save(make_checkpoint(step), epoch=0, force=True)

    fresh = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory))
    assert not fresh.continues_existing_run()
    with pytest.raises(RunDirectoryInUse, match="ckpt"):
        fresh.save(make_checkpoint(5), epoch=0, force=True)  # without the trainer, the first save checks
    with pytest.raises(RunDirectoryInUse):
        fresh.save_model({"model": {}}, 5)
    assert names_in(directory) == [checkpoint_name(10), checkpoint_name(20)]

    by_dir = DefaultCheckpointer(
        DefaultCheckpointerArguments(save_dir=directory, load_dir=str(tmp_path / "ckpt" / ".." / "ckpt"))
    )
    assert by_dir.continues_existing_run()
    by_file = DefaultCheckpointer(
        DefaultCheckpointerArguments(save_dir=directory, load_filename=os.path.join(directory, checkpoint_name(10)))
    )
    assert by_file.continues_existing_run() and by_file.load().global_step == 10
    by_file.save(make_checkpoint(15), epoch=0, force=True)  # this run's own future is set aside, as before
    assert names_in(directory) == [checkpoint_name(10), checkpoint_name(15), checkpoint_name(20) + STALE_SUFFIX]

    elsewhere = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path / "new"), load_dir=directory))
    assert not elsewhere.continues_existing_run()  # fine-tuning from another run: its own save_dir is empty
    elsewhere.prepare_run()


def test_owning_run_removes_leftover_temporaries(tmp_path, checkpoint_log):
    directory = tmp_path / "ckpt"
    DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory))).save(make_checkpoint(4), epoch=0, force=True)
    leftovers = [f".checkpoint-000000008.pt.{'a' * 32}.tmp", f".model-000000008.pt.{'b' * 32}.tmp"]
    for name in leftovers:
        (directory / name).write_bytes(b"half a file")
    (directory / "notes.txt").write_text("the user's own file")

    refused = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory)))
    with pytest.raises(RunDirectoryInUse):
        refused.prepare_run()
    assert all((directory / name).exists() for name in leftovers)  # not this run's to tidy

    owner = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory), resume="auto"))
    owner.prepare_run()
    assert names_in(str(directory)) == [checkpoint_name(4), "notes.txt"]
    removed = [r.getMessage() for r in checkpoint_log if "did not finish" in r.getMessage()]
    assert len(removed) == 2


def test_check_output_dir_free_rules(tmp_path):
    check_output_dir_free(str(tmp_path / "missing"), resuming=False)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "tensorboard").mkdir()
    check_output_dir_free(str(tmp_path), resuming=False)  # empty folders hold nothing to lose
    (tmp_path / "checkpoints" / "model-000000003.pt").write_bytes(b"x")
    with pytest.raises(RunDirectoryInUse, match=re.escape("checkpoints/model-000000003.pt")):
        check_output_dir_free(str(tmp_path), resuming=False)
    check_output_dir_free(str(tmp_path), resuming=True)


def _ddp_rerun(rank: int, out: str) -> str:
    args = TrainerArguments(
        epochs=1,
        train_batch_size=32,
        backend="ddp",
        disable_tqdm=True,
        log_level="ERROR",
        output_dir=out,
        output_dir_in_use="error",
        ddp_timeout=30,
    )
    trainer = Trainer(ToyModule(n_train=128), args)
    try:
        trainer.train()
    except RunDirectoryInUse as error:
        return str(error)
    finally:
        trainer.close()
    return "trained"


@pytest.mark.distributed
def test_ddp_rerun_is_refused_on_every_rank(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.csv").write_text("epoch,step,name,value\n0,4,val_loss,0.5\n")
    messages = run_ranks(_ddp_rerun, timeout=60, out=str(out))
    assert str(out) in messages[0] and "metrics.csv" in messages[0]
    assert messages[1].startswith("rank zero refused to start the run") and "metrics.csv" in messages[1]
    assert (out / "metrics.csv").read_text() == "epoch,step,name,value\n0,4,val_loss,0.5\n"


# -- 3. divergence never eats the best checkpoint ---------------------------------------------
@pytest.mark.parametrize("mode, best_step", [("min", 1), ("max", 2)])
def test_nan_and_inf_rank_worst_in_both_modes(tmp_path, mode, best_step):
    scores = {1: 1.0, 2: 5.0, 3: float("nan"), 4: float("inf"), 5: float("-inf"), 6: float("nan"), 7: 3.0}
    args = DefaultCheckpointerArguments(save_dir=str(tmp_path), keep_last_n=1, keep_best_n=1, mode=mode, save_non_finite=True)
    checkpointer = DefaultCheckpointer(args)
    for step, score in scores.items():
        checkpointer.save(make_checkpoint(step, metrics={"val_loss": score}), epoch=step, force=True)
        if step >= best_step:  # once written, the best survives every NaN and inf after it
            assert (tmp_path / checkpoint_name(best_step)).exists()
    assert names_in(str(tmp_path)) == sorted([checkpoint_name(best_step), checkpoint_name(7)])
    assert checkpointer.best_checkpoint() == str(tmp_path / checkpoint_name(best_step))

    only_nan = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path / "nan"), save_non_finite=True, mode=mode))
    only_nan.save(make_checkpoint(1, metrics={"val_loss": float("nan")}), epoch=1, force=True)
    assert only_nan.best_checkpoint() is None


def test_non_finite_checkpoints_are_skipped_with_a_warning(tmp_path, checkpoint_log):
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path)))
    assert checkpointer.save(make_checkpoint(1, metrics={"val_loss": 0.5}), epoch=0, force=True)
    assert checkpointer.save(make_checkpoint(2, metrics={"val_loss": float("nan")}), epoch=0, force=True) is None
    assert checkpointer.save(make_checkpoint(3, value=float("inf"), metrics={"val_loss": 0.4}), epoch=0, force=True) is None
    assert names_in(str(tmp_path)) == [checkpoint_name(1)]
    warnings = [r.getMessage() for r in checkpoint_log if r.levelno == logging.WARNING]
    assert any("step 2 not written" in w and "val_loss is nan" in w for w in warnings), warnings
    assert any("step 3 not written" in w and "'model.w'" in w and "save_non_finite" in w for w in warnings), warnings

    allowed = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path / "allowed"), save_non_finite=True))
    assert allowed.save(make_checkpoint(3, value=float("inf")), epoch=0, force=True)
    assert torch.isinf(allowed.read(str(tmp_path / "allowed" / checkpoint_name(3))).module_state["model"]["w"]).all()


class PoisonWeights(Callback):
    """Sets one weight to NaN after optimizer step ``at`` (a diverged run)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step == self.at:
            with torch.no_grad():
                self.trainer.module.net[0].weight[0, 0] = float("nan")


def test_diverged_trainer_run_keeps_its_best_checkpoint(tmp_path, checkpoint_log):
    directory = tmp_path / "run" / "checkpoints"
    poison = (PoisonWeights(at=STEPS_PER_EPOCH + 1),)
    # By default the NaN training loss ends the run at the next read, before any save of it.
    with pytest.raises(TrainingDiverged):
        train(tmp_path / "stopped", epochs=3, callbacks=poison, keep_last_n=1, keep_best_n=1)
    assert names_in(str(tmp_path / "stopped" / "checkpoints")) == [checkpoint_name(STEPS_PER_EPOCH)]
    # Training on regardless, the checkpointer itself refuses the NaN weights.
    train(tmp_path / "run", epochs=3, callbacks=poison, stop_on_nonfinite_loss=False, keep_last_n=1, keep_best_n=1)
    # Epoch 1 (step 4) was written; epoch 2 and the final save hold NaN weights and val_loss.
    assert names_in(str(directory)) == [checkpoint_name(STEPS_PER_EPOCH)]
    skipped = [r.getMessage() for r in checkpoint_log if "not written" in r.getMessage()]
    assert [f"step {2 * STEPS_PER_EPOCH} " in skipped[0], f"step {3 * STEPS_PER_EPOCH} " in skipped[1]] == [True, True]
    loaded = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory), resume="auto")).load()
    assert loaded.global_step == STEPS_PER_EPOCH and torch.isfinite(loaded.module_state["model"]["net.0.weight"]).all()


# -- 4. hostile files --------------------------------------------------------------------------
def _malicious_pickle(marker: str) -> bytes:
    """A protocol-0 pickle that calls ``posix.system("touch <marker>")`` when unpickled."""
    return b"cposix\nsystem\n(S'touch " + marker.encode() + b"'\ntR."


def _torch_zip_with(data_pkl: bytes) -> bytes:
    """A real ``torch.save`` archive whose ``data.pkl`` record is replaced (CRCs are valid)."""
    buffer = io.BytesIO()
    torch.save(make_checkpoint(4).to_dict(), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    crafted = io.BytesIO()
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            archive.writestr(name, data_pkl if name.endswith("/data.pkl") else source.read(name))
    return crafted.getvalue()


def _good_then(directory: Any, newest: bytes) -> str:
    """``directory`` holding a good checkpoint at step 2 and ``newest`` at step 4; returns the newest's path."""
    DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory))).save(make_checkpoint(2), epoch=0, force=True)
    path = os.path.join(directory, checkpoint_name(4))
    with open(path, "wb") as handle:
        handle.write(newest)
    return path


def test_blocked_module_in_pickle_is_refused_and_stops_the_run(tmp_path):
    marker = str(tmp_path / "code-ran")
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    evil = _good_then(directory, _torch_zip_with(_malicious_pickle(marker)))
    storage.verify(*storage.resolve(evil))  # intact archive: this is not damage

    with pytest.raises(CheckpointRefused) as refused:
        DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(directory), resume="auto")).load()
    assert evil in str(refused.value) and "posix.system" in str(refused.value)

    counter = StepCounter()  # through the trainer: the run stops, never resumes from step 2
    trainer = Trainer(ToyModule(n_train=128), run_args(tmp_path / "run", resume="auto"), callbacks=[counter])
    with pytest.raises(CheckpointRefused, match=checkpoint_name(4)):
        trainer.train()
    assert counter.steps == 0
    assert not os.path.exists(marker)
    assert names_in(str(directory)) == [checkpoint_name(2), checkpoint_name(4)]  # nothing renamed or removed


@pytest.mark.parametrize("weights_only", [True, False])
def test_pickle_zip_polyglot_is_refused(tmp_path, weights_only):
    marker = str(tmp_path / "code-ran")
    buffer = io.BytesIO()
    torch.save(make_checkpoint(4).to_dict(), buffer)
    polyglot = _malicious_pickle(marker) + buffer.getvalue()
    assert zipfile.ZipFile(io.BytesIO(polyglot)).testzip() is None  # zip readers accept it
    path = _good_then(tmp_path, polyglot)

    args = DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto", weights_only=weights_only)
    with pytest.raises(CheckpointRefused) as refused:
        DefaultCheckpointer(args).load()
    assert path in str(refused.value) and "bytes before its zip archive" in str(refused.value)
    assert not os.path.exists(marker)
    assert names_in(str(tmp_path)) == [checkpoint_name(2), checkpoint_name(4)]


def test_only_damaged_files_fall_back(tmp_path):
    path = _good_then(tmp_path, b"")
    DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path / "x"))).save(
        make_checkpoint(4, value=7.25), epoch=0, force=True
    )
    data = bytearray((tmp_path / "x" / checkpoint_name(4)).read_bytes())
    weights = data.index(struct.pack("<4f", 7.25, 7.25, 7.25, 7.25))
    data[weights] ^= 0xFF  # a flipped bit in the weights: torch.load would not notice, the CRC does
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    assert DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto")).load().global_step == 2

    future = make_checkpoint(4).to_dict()
    future["version"] = 99  # intact, but written by another format version: an error, not a silent fall back
    torch.save(future, path)
    with pytest.raises(ValueError, match=f"{checkpoint_name(4)}.*version 99"):
        DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=str(tmp_path), resume="auto")).load()


# -- 4. failing storage -----------------------------------------------------------------------
class _NoSpaceFile(MemoryFile):
    def __init__(self, fs: Any, path: str, error_number: int) -> None:
        super().__init__(fs, path)
        self.error_number = error_number

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > 256:  # the disk fills up part-way through the file
            raise OSError(self.error_number, os.strerror(self.error_number))
        return super().write(data)


class FaultyFileSystem(MemoryFileSystem):
    """An in-memory filesystem (own store) whose listing, reading or writing fails on demand.

    ``faults[operation] = (errno, path substring, failures left or None for always)``, with
    operation ``"ls"``, ``"read"`` or ``"write"``; ``calls`` counts each operation.
    """

    protocol = "faultyfs"
    store: ClassVar[Dict[str, Any]] = {}
    pseudo_dirs: ClassVar[List[str]] = [""]
    faults: ClassVar[Dict[str, Any]] = {}
    calls: ClassVar[Dict[str, int]] = {}

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return MemoryFileSystem._strip_protocol(path[len("faultyfs://") :] if path.startswith("faultyfs://") else path)

    @classmethod
    def _fault(cls, operation: str, path: str) -> Optional[int]:
        cls.calls[operation] = cls.calls.get(operation, 0) + 1
        fault = cls.faults.get(operation)
        if fault is None or fault[1] not in path:
            return None
        error_number, _, left = fault
        if left is not None:
            if left == 0:
                return None
            cls.faults[operation] = (error_number, fault[1], left - 1)
        return error_number

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        error_number = self._fault("ls", path)
        if error_number is not None:
            raise OSError(error_number, os.strerror(error_number), path)
        return super().ls(path, detail=detail, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            error_number = self._fault("read", path)
            if error_number is not None:
                raise OSError(error_number, os.strerror(error_number), path)
        elif "w" in mode:
            error_number = self._fault("write", path)
            if error_number is not None:
                handle = _NoSpaceFile(self, self._strip_protocol(path), error_number)
                handle.commit()
                return handle
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def faulty() -> type:
    fsspec.register_implementation("faultyfs", FaultyFileSystem, clobber=True)
    FaultyFileSystem.store.clear()
    FaultyFileSystem.pseudo_dirs[:] = [""]
    FaultyFileSystem.faults.clear()
    FaultyFileSystem.calls.clear()
    yield FaultyFileSystem
    FaultyFileSystem.faults.clear()


def _two_checkpoints(directory: str) -> None:
    writer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory))
    for step in (2, 4):
        writer.save(make_checkpoint(step, value=step), epoch=0, force=True)


def test_passing_storage_errors_are_retried(faulty, checkpoint_log):
    directory = "faultyfs://flaky/ckpt"
    _two_checkpoints(directory)
    faulty.faults.update(ls=(errno.EIO, "", 2), read=(errno.EIO, checkpoint_name(4), 2))
    loaded = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory, resume="auto")).load()
    assert loaded.global_step == 4  # not the older one
    retries = [r.getMessage() for r in checkpoint_log if "retrying" in r.getMessage()]
    assert len(retries) == 4 and all("Input/output error" in r for r in retries)


@pytest.mark.parametrize("operation, error_number", [("ls", errno.EIO), ("read", errno.EIO), ("read", errno.EACCES)])
def test_persistent_storage_errors_are_raised_never_resumed_around(tmp_path, faulty, operation, error_number):
    directory = "faultyfs://broken/ckpt"
    _two_checkpoints(directory)
    faulty.faults[operation] = (error_number, checkpoint_name(4) if operation == "read" else "", None)
    faulty.calls.clear()
    checkpointer = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory, resume="auto"))
    with pytest.raises(OSError) as raised:
        checkpointer.load()
    assert raised.value.errno == error_number and not isinstance(raised.value, FileNotFoundError)
    assert faulty.calls[operation] == len(storage.RETRY_DELAYS) + 1
    assert ("listing checkpoints in" if operation == "ls" else checkpoint_name(4)) in str(raised.value)
    assert checkpointer.loaded_from is None

    counter = StepCounter()  # a trainer stops instead of starting fresh or from step 2
    trainer = Trainer(ToyModule(n_train=128), run_args(tmp_path / "run", save_dir=directory, resume="auto"), callbacks=[counter])
    with pytest.raises(OSError):
        trainer.train()
    assert counter.steps == 0


@pytest.mark.parametrize(
    "async_save, error_number", [(False, errno.ENOSPC), (True, errno.ENOSPC), (False, errno.EIO), (True, errno.EIO)]
)
def test_failed_write_names_the_checkpoint_and_the_os_error(tmp_path, faulty, async_save, error_number):
    directory = f"faultyfs://full-{async_save}-{error_number}/ckpt"
    final = 2 * STEPS_PER_EPOCH
    faulty.faults["write"] = (error_number, checkpoint_name(final), None)  # the epoch-1 save fits, the final one not
    trainer = Trainer(ToyModule(n_train=128), run_args(tmp_path / "run", save_dir=directory, async_save=async_save))
    with pytest.raises((CheckpointWriteError, RuntimeError)) as raised:
        trainer.train()
    error = raised.value
    message = str(error)
    assert checkpoint_name(final) in message and os.strerror(error_number) in message, message
    assert "inline_container" not in message
    if async_save:
        assert message.startswith("a background checkpoint save failed") and isinstance(error.__cause__, CheckpointWriteError)
        error = error.__cause__
    assert isinstance(error, CheckpointWriteError) and error.errno == error_number
    assert trainer.global_steps_finished == final

    assert names_in(directory) == [checkpoint_name(STEPS_PER_EPOCH)]  # no temporary left, the previous one intact
    loaded = DefaultCheckpointer(DefaultCheckpointerArguments(save_dir=directory, resume="auto")).load()
    assert loaded.global_step == STEPS_PER_EPOCH


class NumpyStateToy(ToyModule):
    """Keeps numpy arrays and numpy/Python RNG states in its user state (an RL agent's buffer and generators)."""

    def __init__(self) -> None:
        super().__init__(n_train=128, scheduler="step")
        import numpy

        self.buffer = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
        self.np_rng = numpy.random.default_rng(5)
        self.py_rng = random_module.Random(7)
        self.restored: Dict[str, Any] = {}

    def get_state(self) -> Dict[str, Any]:
        import numpy

        return {
            **super().get_state(),
            "buffer": self.buffer,
            "np_rng": self.np_rng,
            "np_global": numpy.random.get_state(),
            "py_rng": self.py_rng,
            "py_global": random_module.getstate(),
            "count": numpy.int64(3),
        }

    def update_state(self, state: Dict[str, Any]) -> None:
        super().update_state(state)
        self.restored = state


def test_numpy_arrays_and_rng_states_in_user_state_load_with_weights_only(tmp_path):
    import numpy

    Trainer(NumpyStateToy(), run_args(tmp_path / "run", epochs=1)).train()
    resumed = NumpyStateToy()
    Trainer(resumed, run_args(tmp_path / "run", epochs=2, resume="auto")).train()  # weights_only=True (the default)
    state = resumed.restored
    assert state["buffer"].tolist() == [[0, 1, 2], [3, 4, 5]] and state["buffer"].dtype == numpy.float32
    assert state["np_rng"].random() == numpy.random.default_rng(5).random()
    assert state["py_rng"].random() == random_module.Random(7).random()
    assert state["np_global"][0] == "MT19937" and state["count"] == 3 and len(state["py_global"][1]) == 625
