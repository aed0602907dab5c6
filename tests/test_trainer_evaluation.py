"""The trainer's evaluation component (``trainer.evaluation``): what it remembers between calls."""

import pytest
from logs import captured_log

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.run.run_directory import RunDirectoryInUse


def test_weights_a_call_loaded_are_known_to_later_calls(tmp_path):
    # Mutant: TrainerEvaluation.load_checkpoint_weights forgets (weights_loaded stays False).
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints)).train()
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints))
    with captured_log("framework") as messages:
        trainer.validate()  # untrained weights while a checkpoint waits: a warning
        assert sum("neither trained nor loaded" in m for m in messages) == 1
        loaded = trainer.validate(checkpoint="last")
        again = trainer.validate()  # the loaded weights: no second warning
    assert sum("neither trained nor loaded" in m for m in messages) == 1
    assert again == loaded


def _files(directory):
    """Every file under ``directory`` (metrics.png left out: a finished run draws it in the background) and its bytes."""
    return {path: path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file() and path.name != "metrics.png"}


def test_an_evaluation_never_rewrites_a_finished_runs_files(tmp_path):
    # Mutant: RunClaim.note_evaluation does not move (the evaluation's loggers rewrite the finished run's
    # metrics.csv from an empty history: its whole training record replaced by one val_loss row).
    checkpoints = DefaultCheckpointerArguments(period=1)
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints)).train()
    finished = _files(tmp_path / "run")
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints))
    trainer.validate(checkpoint=str(next((tmp_path / "run" / "checkpoints").iterdir())))
    assert {path: data for path, data in _files(tmp_path / "run").items() if "version_1" not in str(path)} == finished
    evaluation = (tmp_path / "run" / "version_1" / "metrics.csv").read_text().splitlines()
    assert evaluation[0] == "epoch,step,name,value" and [row.split(",")[2] for row in evaluation[1:]] == ["val_loss"]
    trainer.train()  # the same run trains where its evaluation went: one run, one directory
    assert (tmp_path / "run" / "version_1" / "checkpoints").is_dir() and not (tmp_path / "run" / "version_2").exists()
    assert evaluation[1] in (tmp_path / "run" / "version_1" / "metrics.csv").read_text().splitlines()


def test_an_evaluation_before_resuming_appends_to_the_runs_metrics(tmp_path):
    # Mutant: CSVLogger.start ignores RunInfo.keep_existing (the run it continues loses its rows until train() resumes).
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints)).train()
    written = (tmp_path / "run" / "metrics.csv").read_text()
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints))
    trainer.validate(checkpoint="last")
    trainer.validate(checkpoint="last")  # a second call appends again: the run's rows are never rewritten
    now = (tmp_path / "run" / "metrics.csv").read_text()
    assert now.startswith(written) and [row.split(",")[2] for row in now[len(written) :].splitlines()] == ["val_loss"] * 2
    assert not (tmp_path / "run" / "version_1").exists()


def test_an_evaluation_in_another_runs_directory_is_refused_when_asked(tmp_path):
    # Mutant: note_evaluation writes into output_dir when output_dir_in_use="error" (move_if_taken stays put).
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32)).train()
    finished = _files(tmp_path / "run")
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, output_dir_in_use="error"))
    with pytest.raises(RunDirectoryInUse, match="already holds another run's files"):
        trainer.validate()
    assert _files(tmp_path / "run") == finished
