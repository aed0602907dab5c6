"""framework/run/shared_storage.py in one process: rank zero's side of the check, with rank 1's
reads done on a directory of the test's choosing (the real 2-rank and 2-node runs are in
tests/test_checkpoint_sharded.py and tests/test_multinode.py)."""

import os

import pytest

from framework.checkpoint import DefaultCheckpointer
from framework.run.shared_storage import TOKEN_PREFIX, StorageNotShared, _read_token, check_shared_storage, run_directories


class RankZeroOfTwo:
    """Rank zero of a 2-rank backend whose rank 1 (on host node2) looks at ``rank1_sees[label]``."""

    world_size, is_main_process = 2, True

    def __init__(self, rank1_sees):
        self.rank1_sees, self.tokens = rank1_sees, None

    def run_on_rank_zero(self, compute, what, share_as=()):
        self.tokens = compute()
        return self.tokens

    def all_gather_object(self, obj):
        rank1 = {label: _read_token(location, *self.tokens[label]) for label, location in self.rank1_sees.items()}
        return [obj, ("node2", rank1)]


def test_the_same_storage_everywhere_passes_and_leaves_nothing(tmp_path):
    directories = run_directories(str(tmp_path / "run"), DefaultCheckpointer(default_dir=str(tmp_path / "run" / "checkpoints")))
    check_shared_storage(directories, RankZeroOfTwo(directories))
    assert os.listdir(tmp_path / "run") == ["checkpoints"] and os.listdir(tmp_path / "run" / "checkpoints") == []


def test_a_directory_rank_one_does_not_share_is_refused_by_name(tmp_path):
    out, elsewhere = str(tmp_path / "run"), str(tmp_path / "node2-disk")
    directories = {"output_dir (--trainer.output_dir)": out}
    with pytest.raises(StorageNotShared) as refused:
        check_shared_storage(directories, RankZeroOfTwo({"output_dir (--trainer.output_dir)": elsewhere}))
    message = str(refused.value)
    assert f"output_dir (--trainer.output_dir) {out!r} is not the same storage on every node" in message
    assert "rank 1 (host node2): it is not there" in message and TOKEN_PREFIX in message
    assert "shared filesystem" in message and "fsspec URL" in message
    assert os.listdir(out) == []  # the token is removed


def test_one_process_has_nothing_to_check(tmp_path):
    class One:
        world_size = 1

    check_shared_storage({"output_dir (--trainer.output_dir)": str(tmp_path / "run")}, One())
    assert not (tmp_path / "run").exists()
