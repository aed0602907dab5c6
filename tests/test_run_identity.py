"""Run identity (framework/run/run_identity.py): an id in config.yaml and every checkpoint, checked on resume.

Real trainers write real files; a checkpoint is "copied in" from another run with shutil.
"""

import os
import shutil
from typing import ClassVar, List

import pytest
import torch
import yaml

from distributed import run_ranks
from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointer, DefaultCheckpointerArguments
from framework.config.cli import parse_config
from framework.run.run_identity import ForeignCheckpoint, recorded_run_id


def checkpoints(**overrides):
    return DefaultCheckpointerArguments(**{"period": 1, "resume": "auto", **overrides})


def train(directory, epochs, **checkpointer):
    trainer = Trainer(
        ToyModule(n_train=64, scheduler="step"), toy_args(directory, checkpoints(**checkpointer), epochs=epochs, log_level="INFO")
    )
    trainer.train()
    return trainer


def saved_run_id(path):
    return torch.load(path, weights_only=True)["trainer"]["run_id"]


def newest(directory):
    folder = os.path.join(directory, "run", "checkpoints")
    return os.path.join(folder, sorted(os.listdir(folder))[-1])


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """One finished run: 2 epochs with a checkpoint at each end."""
    directory = tmp_path_factory.mktemp("a")
    return directory, train(directory, epochs=2)


def test_the_run_id_is_in_config_yaml_and_every_checkpoint_and_a_resume_keeps_it(run_a, tmp_path):
    directory, trainer = run_a
    assert len(trainer.run_id) == 32
    assert recorded_run_id(os.path.join(directory, "run")) == trainer.run_id
    folder = os.path.join(directory, "run", "checkpoints")
    assert {saved_run_id(os.path.join(folder, name)) for name in os.listdir(folder)} == {trainer.run_id}
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(directory, resumed_dir)
    resumed = train(resumed_dir, epochs=3)  # resume="auto": the same command with one more epoch
    assert resumed.run_id == trainer.run_id
    assert saved_run_id(newest(resumed_dir)) == trainer.run_id
    assert recorded_run_id(os.path.join(resumed_dir, "run")) == trainer.run_id
    # the saved config.yaml still loads as a config: its run_id is no setting
    config = parse_config(argv=["--config", os.path.join(resumed_dir, "run", "config.yaml")])
    assert config.trainer.epochs == 3


def test_a_checkpoint_copied_in_from_another_run_is_refused_naming_both_runs(run_a, tmp_path, framework_log):
    directory, run = run_a
    other = train(tmp_path / "b", epochs=1)
    assert other.run_id != run.run_id
    # under its own name (a name that disagrees with the step inside is refused as damaged: test_one_door.py)
    copied = os.path.join(tmp_path, "b", "run", "checkpoints", os.path.basename(newest(directory)))
    shutil.copy(newest(directory), copied)
    assert sorted(os.listdir(os.path.dirname(copied)))[-1] == os.path.basename(copied)  # resume="auto" takes it
    before = sorted(os.listdir(os.path.dirname(copied)))
    with pytest.raises(ForeignCheckpoint) as refused:
        train(tmp_path / "b", epochs=3)
    message = str(refused.value)
    assert run.run_id in message and other.run_id in message and copied in message
    assert "load_filename" in message and "Move that checkpoint away" in message
    assert sorted(os.listdir(os.path.dirname(copied))) == before  # nothing renamed, nothing written
    assert recorded_run_id(os.path.join(tmp_path, "b", "run")) == other.run_id

    # named explicitly (fine-tuning from it): accepted in a new output_dir, with a new id, and logged
    framework_log.clear()
    tuned = train(tmp_path / "c", epochs=3, resume=None, load_filename=copied)
    assert tuned.run_id not in (run.run_id, other.run_id)
    assert tuned.global_steps_finished > run.global_steps_finished
    assert any(f"starts from checkpoint {copied} of run {run.run_id}" in line for line in framework_log)


def test_checkpoints_written_before_run_ids_existed_resume_without_error(run_a, tmp_path):
    directory, run = run_a
    old_dir = tmp_path / "old"
    shutil.copytree(directory, old_dir)
    for name in os.listdir(old_dir / "run" / "checkpoints"):
        path = old_dir / "run" / "checkpoints" / name
        data = torch.load(path, weights_only=True)
        del data["trainer"]["run_id"]
        torch.save(data, path)
    config = yaml.safe_load((old_dir / "run" / "config.yaml").read_text())
    del config["run_id"]
    (old_dir / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    os.remove(old_dir / "run" / "run_id")  # the record of its own came later too
    resumed = train(old_dir, epochs=3)
    assert resumed.global_steps_finished == run.global_steps_finished * 3 // 2
    assert saved_run_id(newest(old_dir)) == resumed.run_id != run.run_id


def _ddp_resumes(rank, foreign, optimizer_changed, shared_save_dir):
    """Rank ``rank`` of 2 resumes three directories under ddp (the last from another run's
    ``save_dir``): what each resume raised."""
    import torch.distributed as dist
    from test_optimizer_changes import Configurable

    dist.init_process_group("gloo")  # one group for every trainer (each uses the caller's group)
    outcomes = []
    cases = (
        (foreign, ToyModule(n_train=64, scheduler="step"), None),
        (optimizer_changed, Configurable(kind="adam"), None),
        (os.path.join(foreign, "second"), ToyModule(n_train=64, scheduler="step"), shared_save_dir),
    )
    for directory, module, save_dir in cases:
        args = toy_args(directory, checkpoints(save_dir=save_dir), epochs=3, backend="ddp")
        trainer = Trainer(module, args)
        try:
            trainer.train()
            outcomes.append("trained")
        except Exception as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        finally:
            trainer.close()
    dist.destroy_process_group()
    return outcomes


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_refuses_a_foreign_checkpoint_and_another_optimizer_on_both_ranks(run_a, tmp_path):
    from test_optimizer_changes import Configurable

    directory, run = run_a
    foreign = tmp_path / "foreign"
    other = train(foreign, epochs=1)
    shutil.copy(newest(directory), foreign / "run" / "checkpoints" / os.path.basename(newest(directory)))  # the newest
    changed = tmp_path / "changed"
    Trainer(Configurable(), toy_args(changed, checkpoints(), epochs=1)).train()  # SGD, then Adam under ddp
    shared = str(tmp_path / "shared-checkpoints")  # a run whose checkpoints go outside its output_dir
    sharer = train(tmp_path / "sharer", epochs=1, save_dir=shared)
    kept = sorted(os.listdir(shared))
    outcomes = run_ranks(_ddp_resumes, timeout=120, foreign=str(foreign), optimizer_changed=str(changed), shared_save_dir=shared)
    for rank_outcomes in outcomes:  # every rank stopped (none hung), each naming what is wrong
        refused, mismatch, adopted = rank_outcomes
        assert refused.startswith("ForeignCheckpoint") and run.run_id in refused and other.run_id in refused
        assert mismatch.startswith("CheckpointMismatch") and "class SGD" in mismatch and "Adam" in mismatch
        assert adopted.startswith("ForeignCheckpoint") and sharer.run_id in adopted and "two runs share one save_dir" in adopted
    assert sorted(os.listdir(shared)) == kept  # nothing adopted, nothing deleted


def test_two_runs_in_two_output_dirs_sharing_one_save_dir_in_sequence_the_second_adopts_nothing(tmp_path):
    from framework.checkpoint import RunDirectoryInUse

    shared = str(tmp_path / "shared-checkpoints")
    first = train(tmp_path / "first", epochs=2, save_dir=shared, keep_last_n=1)
    kept = sorted(os.listdir(shared))
    assert len(kept) == 1
    with pytest.raises(ForeignCheckpoint) as refused:  # resume="auto" from another output_dir
        train(tmp_path / "second", epochs=3, save_dir=shared, keep_last_n=1)
    message = str(refused.value)
    assert first.run_id in message and str(tmp_path / "first" / "run") in message and "choose another save_dir" in message
    assert sorted(os.listdir(shared)) == kept  # nothing adopted, nothing deleted
    with pytest.raises(RunDirectoryInUse, match="already holds checkpoints of another run"):  # without resume
        train(tmp_path / "second", epochs=3, save_dir=shared, resume=None)
    resumed = train(tmp_path / "first", epochs=3, save_dir=shared, keep_last_n=1)  # the owner resumes
    assert resumed.run_id == first.run_id and resumed.global_steps_finished > first.global_steps_finished
    shutil.rmtree(tmp_path / "first")  # the owner's output_dir is gone: its checkpoints may be continued
    continued = train(tmp_path / "second", epochs=4, save_dir=shared, keep_last_n=1)
    assert continued.run_id == first.run_id


def test_a_finished_run_resumed_says_nothing_is_left_to_do_and_which_settings_differ(run_a, tmp_path, framework_log):
    shutil.copytree(run_a[0] / "run", tmp_path / "run")  # a finished 2-epoch run (copied: run_a stays as it is)
    finished = run_a[1].global_steps_finished
    fewer = train(tmp_path, epochs=1)
    assert fewer.global_steps_finished == finished
    said = [line for line in framework_log if "nothing to do" in line]
    assert len(said) == 1 and f"finished at step {finished} (2 epochs)" in said[0] and "trainer.epochs: 2 -> 1" in said[0]
    framework_log.clear()
    train(tmp_path, epochs=1)  # the same command again: its settings are now the run's own
    said = [line for line in framework_log if "nothing to do" in line]
    assert len(said) == 1 and "the settings are the run's own" in said[0]


def test_retention_renames_and_deletes_only_this_runs_checkpoints(tmp_path):
    shared = tmp_path / "shared"
    first = Trainer(ToyModule(n_train=64, scheduler=None), toy_args(tmp_path / "x", checkpoints(save_dir=str(shared)), epochs=3))
    first.train()  # checkpoints at steps 2, 4, 6 of run x
    theirs = {name: os.stat(shared / name).st_mtime_ns for name in os.listdir(shared)}
    assert sorted(theirs) == ["checkpoint-000000002.pt", "checkpoint-000000004.pt", "checkpoint-000000006.pt"]
    # another run fine-tunes from x's step 2 into the same save_dir, keeping only its newest
    named = checkpoints(save_dir=str(shared), resume=None, load_filename=str(shared / "checkpoint-000000002.pt"), keep_last_n=1)
    second = Trainer(ToyModule(n_train=64, scheduler=None), toy_args(tmp_path / "y", named, epochs=3))
    second.train()  # writes steps 4 and 6 of its own: x's newer ones would be renamed .stale, older deleted
    assert second.run_id != first.run_id
    names = sorted(os.listdir(shared))
    assert not [name for name in names if name.endswith(".stale")], names
    assert {saved_run_id(shared / name) for name in names} == {first.run_id, second.run_id}
    kept = {name for name in names if saved_run_id(shared / name) == first.run_id}
    assert {name: os.stat(shared / name).st_mtime_ns for name in kept} == {
        name: mtime for name, mtime in theirs.items() if name in kept
    }
    assert kept == {"checkpoint-000000002.pt"}  # 4 and 6 were overwritten by the second run's own saves of those steps


class RecordingCheckpointer(DefaultCheckpointer):
    """Records the name of every file it serializes into (the temporary name of each save)."""

    written: ClassVar[List[str]] = []

    def serialize(self, obj, handle):
        RecordingCheckpointer.written.append(os.path.basename(getattr(handle, "name", "")))
        super().serialize(obj, handle)


def test_temporaries_name_their_run_and_cleanup_removes_only_this_runs_and_unnamed_ones(tmp_path):
    first = train(tmp_path, epochs=1)
    folder = tmp_path / "run" / "checkpoints"
    uuid_hex = "0" * 32
    own = f".checkpoint-000000009.pt.{first.run_id}{uuid_hex}.tmp"  # its own killed save
    theirs = f".checkpoint-000000009.pt.{'cd' * 16}{uuid_hex}.tmp"  # another run's, perhaps being written
    unnamed = f".checkpoint-000000009.pt.{uuid_hex}.tmp"  # written before temporaries named their run
    for name in (own, theirs, unnamed):
        (folder / name).write_bytes(b"partial")
    RecordingCheckpointer.written = []
    named = checkpoints(save_dir=str(folder))
    checkpointer = RecordingCheckpointer(named)
    resumed = Trainer(ToyModule(n_train=64, scheduler="step"), toy_args(tmp_path, named, epochs=2), checkpointer=checkpointer)
    resumed.train()  # resume="auto": the same run, one more epoch
    assert resumed.run_id == first.run_id
    assert RecordingCheckpointer.written and all(f".{first.run_id}" in name for name in RecordingCheckpointer.written)
    hidden = sorted(name for name in os.listdir(folder) if name.startswith("."))
    assert hidden == [theirs]  # its own and the unnamed leftover removed; the other run's left
