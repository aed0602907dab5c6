"""Sharded (``fsdp``) checkpoints get every protection single-file ones have, on 2 real gloo ranks.

One 2-rank run (``sharded_scenarios``) trains every scenario in one process group:

- an uninterrupted run (the reference), then evaluation from its checkpoints
  (``validate(checkpoint=...)`` and ``load_weights`` in the test process, no process group);
- a run stopped at step 4 whose checkpoints 4, 3 and 2 are damaged three ways (a shard
  deleted, ``.metadata`` truncated, ``.metadata`` replaced by a pickle that would create a file
  when unpickled), resumed: it skips them with a warning and ends equal to the reference;
- a run whose weights turn NaN on one rank's shard at step 6: no rank writes a checkpoint
  from then on, the finite ones are kept, and a rerun resumes from the last finite one;
- a new run pointed at the reference's sharded checkpoints: RunDirectoryInUse on every rank;
- each rank given its own save_dir (as each node its own disk): the run is refused at start on
  every rank (``framework/run/shared_storage.py``), and a sharded save whose shards land in
  different directories is never marked complete (rank zero confirms every shard first);
- a checkpoint whose ``.metadata`` is a pickle that would create a file, with its digest in
  ``state.pt`` rewritten to match: ``validate(checkpoint=...)`` and ``resume="auto"`` refuse it
  on both ranks, ``load_weights`` in the test process too, and no code runs.
"""

import logging
import os
import pickle
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from tiny_transformer import TinyTransformer

from backends.checkpoint_io import CheckpointIO, file_digest, sharded_checkpoint
from framework import Trainer, TrainerArguments
from framework.callbacks import Callback
from framework.checkpoint import CheckpointRefused, RunDirectoryInUse, load_weights
from framework.checkpoint.default import checkpoint_name
from framework.run.run_directory import check_output_dir_free
from framework.run.shared_storage import StorageNotShared

STEPS = 8  # 2 epochs of 4 steps (64 samples, global batch 16)


def arguments(out: str, **overrides: Any) -> TrainerArguments:
    values: Dict[str, Any] = dict(
        epochs=2,
        train_batch_size=16,
        backend="fsdp",
        disable_tqdm=True,
        output_dir=out,
        log_every_n_steps=2,
        sanity_val_steps=0,
    )
    values.update(overrides)
    args = TrainerArguments(**values)
    args.checkpointer_args.save_every_n_steps = 1
    args.checkpointer_args.keep_last_n = None
    return args


def full_weights(trainer: Trainer) -> Dict[str, torch.Tensor]:
    state = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return {name: tensor.detach().clone() for name, tensor in state.items()}


class PoisonShard(Callback):
    """After optimizer step ``at``, one weight of this rank's shard becomes NaN (rank 1 only)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_end_optimizer_step(self, global_step: int) -> None:
        if global_step == self.at and self.trainer.backend.rank == 1:
            with torch.no_grad():
                self.trainer.module.head.weight.to_local().view(-1)[0] = float("nan")


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class WritesAFile:
    """Unpickling it creates ``path`` (what a tampered ``.metadata`` could do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def damage(checkpoints: str, marker: str) -> None:
    """Checkpoint 4: a shard deleted; 3: ``.metadata`` truncated; 2: ``.metadata`` a hostile pickle."""
    os.remove(os.path.join(checkpoints, checkpoint_name(4, ""), "__1_0.distcp"))
    with open(os.path.join(checkpoints, checkpoint_name(3, ""), ".metadata"), "r+b") as handle:
        handle.truncate(40)
    with open(os.path.join(checkpoints, checkpoint_name(2, ""), ".metadata"), "wb") as handle:
        pickle.dump(WritesAFile(marker), handle)


def tamper(checkpoint: str, marker: str) -> None:
    """``.metadata`` replaced by a hostile pickle, and the digest in ``state.pt`` rewritten to match it."""
    with open(os.path.join(checkpoint, ".metadata"), "wb") as handle:
        pickle.dump(WritesAFile(marker), handle)
    state = torch.load(os.path.join(checkpoint, "state.pt"), weights_only=True)
    state["sharded"]["metadata_sha256"] = file_digest(os.path.join(checkpoint, ".metadata"))
    torch.save(state, os.path.join(checkpoint, "state.pt"))


def outcome(action: Any) -> str:
    """``"ran"``, or the error ``action()`` raised, as ``"TypeName: message"``."""
    try:
        action()
        return "ran"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def sharded_scenarios(rank: int, out: str) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    results: Dict[str, Any] = {}
    messages = Messages()
    logging.getLogger("framework.checkpoint.default").addHandler(messages)

    reference_dir = os.path.join(out, "reference")
    reference = Trainer(TinyTransformer(), arguments(reference_dir))
    reference.train()
    results["reference"] = full_weights(reference)
    records = reference.history.records
    results["val_losses"] = {record["step"]: record["value"] for record in records if record["name"] == "val_loss"}
    results["validate_step_4"] = reference.validate(checkpoint=os.path.join(reference_dir, "checkpoints", checkpoint_name(4, "")))
    results["validate_best"] = reference.validate(checkpoint="best")
    results["validate_last"] = reference.validate(checkpoint="last")

    damaged_dir = os.path.join(out, "damaged")
    Trainer(TinyTransformer(), arguments(damaged_dir, max_steps=4)).train()
    if rank == 0:
        damage(os.path.join(damaged_dir, "checkpoints"), os.path.join(out, "pickle-ran"))
    dist.barrier()
    messages.messages.clear()
    resumed_args = arguments(damaged_dir)
    resumed_args.checkpointer_args.resume = "auto"
    resumed = Trainer(TinyTransformer(), resumed_args)
    resumed.train()
    results["resumed"] = full_weights(resumed)
    results["resumed_from"] = resumed.checkpointer.loaded_from
    results["skipped"] = [message for message in messages.messages if "was skipped" in message]
    reshaped_args = arguments(damaged_dir, epochs=3)  # the same run resumed with a wider model
    reshaped_args.checkpointer_args.resume = "auto"
    messages.messages.clear()
    reshaped = Trainer(TinyTransformer(width=32), reshaped_args)
    results["reshaped"] = outcome(reshaped.train)
    results["reshaped_skipped"] = [message for message in messages.messages if "was skipped" in message]
    reshaped.close()

    nan_dir = os.path.join(out, "nan")
    nan_args = arguments(nan_dir, stop_on_nonfinite_loss=False)
    nan_args.checkpointer_args.keep_last_n = 3
    messages.messages.clear()
    Trainer(TinyTransformer(), nan_args, callbacks=[PoisonShard(at=6)]).train()
    results["nan_kept"] = sorted(os.listdir(os.path.join(nan_dir, "checkpoints")))
    results["nan_refused"] = [message for message in messages.messages if "not written" in message]
    rerun_args = arguments(nan_dir, stop_on_nonfinite_loss=False)
    rerun_args.checkpointer_args.resume = "auto"
    rerun = Trainer(TinyTransformer(), rerun_args)
    rerun.train()
    results["rerun_from"] = rerun.checkpointer.loaded_from
    results["rerun_finite"] = all(torch.isfinite(tensor).all() for tensor in full_weights(rerun).values())

    intruder_args = arguments(os.path.join(out, "intruder"))
    intruder_args.checkpointer_args.save_dir = os.path.join(reference_dir, "checkpoints")
    intruder = Trainer(TinyTransformer(), intruder_args)
    try:
        intruder.train()
        results["intruder"] = "trained"
    except RunDirectoryInUse as error:
        results["intruder"] = str(error)
    finally:
        intruder.close()

    own_disk_args = arguments(os.path.join(out, "shared"))  # each rank's save_dir its own (rank zero does not choose it)
    own_disk_args.checkpointer_args.save_dir = os.path.join(out, f"own-disk-{rank}")
    own_disk = Trainer(TinyTransformer(), own_disk_args)
    try:
        own_disk.train()
        results["own_disk"] = "trained"
    except StorageNotShared as error:
        results["own_disk"] = str(error)
    finally:
        own_disk.close()
    split = os.path.join(out, f"split-{rank}", checkpoint_name(1, ""))
    state = {"module": {f"rank{rank}": torch.full((4,), float(rank))}, "trainer": {}}
    write = sharded_checkpoint.prepare_save(
        split, state, CheckpointIO(), is_main=rank == 0, distributed=True, on_rank_zero=lambda make, what: make()
    )
    try:
        write()
        results["split"] = "complete"
    except sharded_checkpoint.ShardsMissing as error:
        results["split"] = str(error)
    results["split_files"] = sorted(os.listdir(os.path.dirname(split)))
    tampered_dir = os.path.join(out, "tampered")
    Trainer(TinyTransformer(), arguments(tampered_dir, max_steps=2)).train()
    tampered = os.path.join(tampered_dir, "checkpoints", checkpoint_name(2, ""))
    if rank == 0:
        tamper(tampered, os.path.join(out, "tampered-pickle-ran"))
    dist.barrier()
    evaluator = Trainer(TinyTransformer(), arguments(tampered_dir))
    results["tampered_validate"] = outcome(lambda: evaluator.validate(checkpoint=tampered))
    tampered_args = arguments(tampered_dir)
    tampered_args.checkpointer_args.resume = "auto"
    tampered_resume = Trainer(TinyTransformer(), tampered_args)
    results["tampered_resume"] = outcome(tampered_resume.train)
    tampered_resume.close()
    logging.getLogger("framework.checkpoint.default").removeHandler(messages)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sharded"))
    return out, run_ranks(sharded_scenarios, out=out, timeout=400)


def max_difference(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


@pytest.mark.distributed
@pytest.mark.slow
def test_damaged_sharded_checkpoints_are_skipped_and_the_run_ends_as_an_uninterrupted_one(runs):
    out, (rank0, rank1) = runs
    assert rank0["resumed_from"].endswith(checkpoint_name(1, "")) and rank1["resumed_from"] == rank0["resumed_from"]
    shard, truncated, hostile = rank0["skipped"]
    assert checkpoint_name(4, "") in shard and "names '__1_0.distcp', which is not in the checkpoint directory" in shard
    assert checkpoint_name(3, "") in truncated and ".metadata does not match the digest" in truncated
    assert checkpoint_name(2, "") in hostile and ".metadata does not match the digest" in hostile
    assert not os.path.exists(os.path.join(out, "pickle-ran"))  # the hostile index was never unpickled
    assert max_difference(rank0["resumed"], rank0["reference"]) <= 1e-5
    assert max_difference(rank1["resumed"], rank0["reference"]) <= 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_a_nan_shard_on_one_rank_stops_every_rank_writing_and_the_rerun_resumes_the_last_finite(runs):
    _, (rank0, _) = runs
    assert rank0["nan_kept"] == [checkpoint_name(step, "") for step in (3, 4, 5)]
    assert [f"step {step} not written" in message for step, message in zip(range(6, 9), rank0["nan_refused"])] == [True] * 3
    assert "on rank 1" in rank0["nan_refused"][0]
    assert rank0["rerun_from"].endswith(checkpoint_name(5, "")) and rank0["rerun_finite"]


@pytest.mark.distributed
@pytest.mark.slow
def test_evaluation_and_load_weights_read_sharded_checkpoints(runs):
    out, (rank0, rank1) = runs
    val_losses = rank0["val_losses"]
    for rank in (rank0, rank1):
        assert rank["validate_step_4"]["val_loss"] == pytest.approx(val_losses[4], abs=1e-6)
        assert rank["validate_best"]["val_loss"] == pytest.approx(min(val_losses.values()), abs=1e-6)
        assert rank["validate_last"]["val_loss"] == pytest.approx(val_losses[STEPS], abs=1e-6)
    module = TinyTransformer()
    url = load_weights(module, os.path.join(out, "reference", "checkpoints"))  # one process, no process group
    assert url.endswith(checkpoint_name(STEPS, ""))
    assert max_difference(dict(module.state_dict()), rank0["reference"]) == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_a_new_run_into_sharded_checkpoints_is_refused_on_every_rank(runs, tmp_path):
    out, (rank0, rank1) = runs
    assert "already holds checkpoints of another run" in rank0["intruder"] and checkpoint_name(1, "") in rank0["intruder"]
    assert rank1["intruder"].startswith("rank zero refused to start the run")
    assert len(os.listdir(os.path.join(out, "reference", "checkpoints"))) == STEPS  # nothing renamed or removed
    os.makedirs(tmp_path / "checkpoints" / checkpoint_name(3, ""))
    with pytest.raises(RunDirectoryInUse, match=checkpoint_name(3, "")):
        check_output_dir_free(str(tmp_path), resuming=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_on_its_own_disk_is_refused_and_split_shards_are_never_marked_complete(runs):
    out, (rank0, rank1) = runs
    for index, rank in enumerate((rank0, rank1)):  # every rank stops, naming its own directory and rank 1
        own = os.path.join(out, f"own-disk-{index}")
        assert (
            f"save_dir (--checkpointer.save_dir, by default <output_dir>/checkpoints) {own!r} is not the same storage"
            in rank["own_disk"]
        )
        assert "rank 1 (host" in rank["own_disk"] and "it is not there" in rank["own_disk"]
        assert "shared filesystem" in rank["own_disk"] and "fsspec URL" in rank["own_disk"]
    assert os.listdir(os.path.join(out, "own-disk-0")) == [] and os.listdir(os.path.join(out, "shared")) == []
    assert "__1_0.distcp (absent)" in rank0["split"] and "not marked complete" in rank0["split"]
    assert rank0["split_files"] == rank1["split_files"] == [f".{checkpoint_name(1, '')}.partial"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_tampered_index_with_its_digest_rewritten_runs_no_code_anywhere(runs):
    out, (rank0, rank1) = runs
    tampered = os.path.join(out, "tampered", "checkpoints", checkpoint_name(2, ""))
    for rank in (rank0, rank1):
        for key in ("tampered_validate", "tampered_resume"):
            assert "CheckpointRefused" in rank[key] and "io.open" in rank[key], rank[key]
    with pytest.raises(CheckpointRefused, match="not a plain DCP index"):
        load_weights(TinyTransformer(), tampered)
    assert not os.path.exists(os.path.join(out, "tampered-pickle-ran"))  # nothing in it was called


@pytest.mark.distributed
@pytest.mark.slow
def test_a_changed_model_shape_is_named_not_reported_as_unreadable_checkpoints(runs):
    _, (rank0, rank1) = runs
    for rank in (rank0, rank1):
        message = rank["reshaped"]
        assert message.startswith("ValueError") and "written by a model of another shape" in message, message
        assert checkpoint_name(STEPS, "") in message and "(32, 16) in the checkpoint, (32, 32) in this run" in message
        assert "unreadable" not in message and "move them away" not in message
        assert rank["reshaped_skipped"] == []  # no good checkpoint called damaged
