"""A run's own files attacked from outside, end to end (issue 49): the drawing process started
beside a ``json.py``, ``config.yaml`` and ``metrics.csv`` replaced by links, a FIFO or a link to
``/dev/zero`` as the run's id record or config, an unreadable record of another run, and
checkpoints of another run that cannot be read. Each test names the fault it catches.
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.run.run_identity import RUN_ID_FILE, UNREADABLE, ForeignCheckpoint, recorded_run_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(directory, epochs, **checkpointer):
    arguments = DefaultCheckpointerArguments(**{"period": 1, "resume": "auto", **checkpointer})
    trainer = Trainer(ToyModule(n_train=64, scheduler="step"), toy_args(directory, arguments, epochs=epochs))
    trainer.train()
    return trainer


def finishes(call, seconds=60):
    """``call()``'s result or its exception; fails the test when it is still running after ``seconds``."""
    outcome = {}

    def attempt():
        try:
            outcome["value"] = call()
        except BaseException as error:
            outcome["error"] = error

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "hung on a special file"
    return outcome


def test_a_run_started_beside_a_json_py_imports_nothing_from_the_working_directory(tmp_path):
    """Fault: the drawing process started with ``python -c`` and the working directory first on its path
    (the WORKER's first lines removed): ``json.py`` beside the user's data runs inside it."""
    pytest.importorskip("matplotlib")  # a dev dependency: installed wherever the suite runs
    data = tmp_path / "data"
    data.mkdir()
    marker = tmp_path / "IMPORTED-FROM-CWD"
    for name in ("json.py", "matplotlib.py", "importlib.py"):
        (data / name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\nraise ImportError('not this one')\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path[:0] = [{os.path.join(ROOT, "tests")!r}, {ROOT!r}]
            from toy import ToyModule, toy_args
            from framework import Trainer
            from framework.metrics.background_plot import wait_for_plots
            Trainer(ToyModule(n_train=64), toy_args({str(tmp_path)!r}, plot_metrics=True)).train()
            print("drawn:", wait_for_plots())
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], cwd=data, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), marker.read_text()
    assert os.path.isfile(tmp_path / "run" / "metrics.png"), done.stdout + done.stderr[-2000:]


def test_links_the_user_names_are_followed_on_purpose(tmp_path):
    """Fault: the door's link refusal applied to what the user chose (a linked --config, load_filename)."""
    from framework.config.cli import parse_config

    real = tmp_path / "configs" / "real.yaml"
    real.parent.mkdir()
    real.write_text("trainer:\n  epochs: 3\n")
    os.symlink(real, tmp_path / "link.yaml")
    assert parse_config(argv=["--config", str(tmp_path / "link.yaml")]).trainer.epochs == 3
    first = train(tmp_path / "a", epochs=1)
    newest = sorted((tmp_path / "a" / "run" / "checkpoints").iterdir())[-1]
    os.symlink(newest, tmp_path / "best.pt")
    tuned = train(tmp_path / "b", epochs=2, resume=None, load_filename=str(tmp_path / "best.pt"))
    assert tuned.checkpointer.loaded_from == str(tmp_path / "best.pt") and tuned.run_id != first.run_id
    assert tuned.global_steps_finished > first.global_steps_finished  # it continued from the linked checkpoint


def test_a_resumed_run_replaces_links_to_config_yaml_and_metrics_csv_and_never_changes_their_targets(tmp_path):
    """Fault: ``config.yaml`` or ``metrics.csv`` opened for writing by name (through the link): the
    user's own YAML and CSV are overwritten by the resumed run."""
    train(tmp_path, epochs=1)
    run = tmp_path / "run"
    own_yaml, own_csv = tmp_path / "my_config.yaml", tmp_path / "my_metrics.csv"
    own_yaml.write_text("trainer:\n  epochs: 7\n")
    own_csv.write_text("mine\n")
    for name, target in (("config.yaml", own_yaml), ("metrics.csv", own_csv)):
        os.remove(run / name)
        os.symlink(target, run / name)
    resumed = train(tmp_path, epochs=2)
    assert resumed.global_steps_finished > 0 and resumed.epochs_finished == 2
    assert own_yaml.read_text() == "trainer:\n  epochs: 7\n" and own_csv.read_text() == "mine\n"
    for name in ("config.yaml", "metrics.csv"):
        assert not os.path.islink(run / name)
    assert "train_loss" in (run / "metrics.csv").read_text() and "run_id" in (run / "config.yaml").read_text()


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_a_special_config_yaml_neither_hangs_nor_fills_memory_and_the_run_id_record_still_answers(tmp_path, special):
    """Fault: config.yaml read whole by name (a FIFO hangs the resume forever; /dev/zero grows until killed)."""
    first = train(tmp_path, epochs=1)
    config = tmp_path / "run" / "config.yaml"
    os.remove(config)
    os.mkfifo(config) if special == "fifo" else os.symlink("/dev/zero", config)
    outcome = finishes(lambda: train(tmp_path, epochs=2))
    assert "error" not in outcome, outcome
    assert outcome["value"].run_id == first.run_id and outcome["value"].epochs_finished == 2


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "garbage"])
def test_an_unreadable_run_id_record_stops_the_resume_naming_it(tmp_path, special):
    """Fault: an unreadable record taken for "no run here": the resume would adopt checkpoints whose owner is unknown."""
    train(tmp_path, epochs=1)
    record = tmp_path / "run" / RUN_ID_FILE
    os.remove(record)
    if special == "fifo":
        os.mkfifo(record)
    elif special == "dev-zero":
        os.symlink("/dev/zero", record)
    else:
        record.write_text("not an id\n")
    assert recorded_run_id(str(tmp_path / "run")) == UNREADABLE
    outcome = finishes(lambda: train(tmp_path, epochs=2))
    assert isinstance(outcome.get("error"), ForeignCheckpoint), outcome
    assert str(record) in str(outcome["error"]) and "cannot be read" in str(outcome["error"])


def test_a_huge_config_yaml_does_not_switch_identity_off(tmp_path):
    """Fault (issue 49): the run id read from config.yaml, which hyper-parameters can push past the YAML
    reader's bounds; a second run then adopted the first one's save_dir. The record is read alone."""
    shared = str(tmp_path / "shared-checkpoints")
    first = train(tmp_path / "a", epochs=1, save_dir=shared)
    config = tmp_path / "a" / "run" / "config.yaml"
    config.write_text(config.read_text() + "vocabulary: [" + ", ".join(f"w{i}" for i in range(100_001)) + "]\n")
    assert recorded_run_id(str(tmp_path / "a" / "run")) == first.run_id
    with pytest.raises(ForeignCheckpoint, match="two runs share one save_dir"):
        train(tmp_path / "b", epochs=2, save_dir=shared)


def test_an_unreadable_record_of_another_run_refuses_adoption(tmp_path):
    """Fault: "unknown" taken for "gone" (the other run's record unreadable -> its checkpoints adopted)."""
    shared = str(tmp_path / "shared-checkpoints")
    train(tmp_path / "a", epochs=1, save_dir=shared)
    record = tmp_path / "a" / "run" / RUN_ID_FILE
    os.remove(record)
    os.mkfifo(record)
    outcome = finishes(lambda: train(tmp_path / "b", epochs=2, save_dir=shared))
    assert isinstance(outcome.get("error"), ForeignCheckpoint), outcome


def test_retention_leaves_checkpoints_it_cannot_read_alone(tmp_path):
    """Fault: a checkpoint whose run id cannot be read (another run's, holding a user object that
    ``weights_only`` refuses) counted as this run's, so ``keep_last_n`` deleted it."""
    save_dir = tmp_path / "checkpoints"
    train(tmp_path, epochs=1, save_dir=str(save_dir))
    unreadable = save_dir / "checkpoint-000000000.pt"  # older than this run's: resume takes this run's own
    torch.save({"trainer": {"run_id": "ab" * 16}, "user": threading.Lock}, unreadable)  # refused by weights_only
    resumed = train(tmp_path, epochs=3, save_dir=str(save_dir), keep_last_n=1)
    assert resumed.epochs_finished == 3
    assert sorted(os.listdir(save_dir)) == ["checkpoint-000000000.pt", f"checkpoint-{resumed.global_steps_finished:09d}.pt"]


def test_a_link_between_save_dir_and_output_dir_is_one_directory(tmp_path):
    """Fault: aliases compared by name: the run locked save_dir (a link to its own output_dir) twice and
    refused itself as "in use by a live run" (its own pid)."""
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "run", tmp_path / "alias")
    trainer = train(tmp_path, epochs=1, save_dir=str(tmp_path / "alias"))
    assert trainer.global_steps_finished > 0
    assert [name for name in os.listdir(tmp_path / "run") if name.startswith("checkpoint-")]


def test_a_full_disk_names_the_field_and_the_file_and_leaves_no_litter(tmp_path):
    """Fault: a failed lock write raised as a raw OSError naming neither the field nor the file, and left
    an empty ``run.lock.<token>.new`` behind each time. The disk is "full" past 64 bytes (RLIMIT_FSIZE)."""
    script = tmp_path / "full.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import resource, signal, sys
            sys.path[:0] = [{os.path.join(ROOT, "tests")!r}, {ROOT!r}]
            from toy import ToyModule, toy_args
            from framework import Trainer
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
            try:
                Trainer(ToyModule(n_train=64), toy_args({str(tmp_path)!r})).train()
            except OSError as error:
                print("REFUSED", error)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in done.stdout, done.stdout + done.stderr[-3000:]
    message = done.stdout
    assert "output_dir" in message and str(tmp_path / "run" / "run.lock") in message and "--trainer.output_dir" in message
    assert [name for name in os.listdir(tmp_path / "run") if name.endswith(".new")] == []


def test_a_full_disk_under_fsdp_is_a_checkpoint_write_error_naming_the_checkpoint(tmp_path):
    """Fault: DCP's raw ``CheckpointException``/``OSError`` (naming neither the checkpoint nor what to do)
    for a disk that fills while a sharded checkpoint is written; the disk is "full" past 48 KiB."""
    script = tmp_path / "full.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import resource, signal, sys
            sys.path[:0] = [{os.path.join(ROOT, "tests")!r}, {ROOT!r}]
            from toy import ToyModule, toy_args
            from framework import Trainer
            from framework.checkpoint import CheckpointWriteError, DefaultCheckpointerArguments
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (48 << 10, 48 << 10))
            args = toy_args({str(tmp_path)!r}, DefaultCheckpointerArguments(period=1), backend="fsdp")
            try:
                Trainer(ToyModule(n_train=64, hidden=512), args).train()
            except CheckpointWriteError as error:
                print("REFUSED", error)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "could not write sharded checkpoint" in done.stdout and "--checkpointer.save_dir" in done.stdout
