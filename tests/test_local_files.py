"""Local checkpoint paths are served without fsspec, exactly as fsspec's local filesystem would."""

import os
import subprocess
import sys
import textwrap

import fsspec
import pytest

from backends.checkpoint_io.local_files import LocalFiles, local_path
from framework.checkpoint import storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("url", ["runs/a", "./runs/a/", "~/runs/a", "/tmp/runs/a/", "file:///tmp/runs/a", "runs/../a", "."])
def test_local_paths_resolve_to_the_path_fsspec_gives(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = storage.resolve(url)
    reference_fs, reference_path = fsspec.core.url_to_fs(url)
    assert isinstance(fs, LocalFiles) and path == reference_path
    assert fs.unstrip_protocol(path) == reference_fs.unstrip_protocol(reference_path)


@pytest.mark.parametrize("url", ["memory://bucket/run", "s3://bucket/run", "simplecache::file:///tmp/x", "C:/runs"])
def test_other_urls_stay_with_fsspec(url):
    assert local_path(url) is None


def test_listing_removing_and_moving_match_fsspec(tmp_path):
    files, reference = LocalFiles(), fsspec.filesystem("file")
    (tmp_path / "checkpoint-000000001.pt").write_bytes(b"x" * 7)
    (tmp_path / "checkpoint-000000002").mkdir()
    (tmp_path / "checkpoint-000000002" / "shard").write_bytes(b"y")
    directory = str(tmp_path)

    def entries(fs):
        return sorted((entry["name"], entry["type"]) for entry in fs.ls(directory, detail=True))

    assert entries(files) == entries(reference)
    assert sorted(files.ls(directory)) == sorted(reference.ls(directory, detail=False))
    assert files.size(f"{directory}/checkpoint-000000001.pt") == 7
    with pytest.raises(FileNotFoundError):
        files.ls(f"{directory}/missing")
    with pytest.raises(IsADirectoryError):
        files.rm(f"{directory}/checkpoint-000000002")  # a directory needs recursive=True
    files.mv(f"{directory}/checkpoint-000000002", f"{directory}/checkpoint-000000002.stale", recursive=True)
    files.rm(f"{directory}/checkpoint-000000002.stale", recursive=True)
    files.rm(f"{directory}/checkpoint-000000001.pt")
    assert files.ls(directory) == [] and not files.exists(f"{directory}/checkpoint-000000001.pt")


def test_a_run_on_the_local_disk_never_imports_fsspec(tmp_path):
    """Saving, resuming and listing checkpoints on a local output_dir: fsspec stays unimported."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
        from framework import Trainer, TrainerArguments
        from toy import ToyModule
        def run(epochs, **checkpointer):
            args = TrainerArguments(epochs=epochs, train_batch_size=8, output_dir={str(tmp_path)!r}, disable_tqdm=True,
                                    checkpointer_args=checkpointer)
            trainer = Trainer(ToyModule(scheduler=None), args)
            trainer.train()
            return trainer
        run(1)
        resumed = run(2, resume="auto")
        assert resumed.checkpointer.loaded_from.startswith("file://"), resumed.checkpointer.loaded_from
        assert "fsspec" not in sys.modules, "fsspec was imported"
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint-000000032.pt", "checkpoint-000000064.pt"]
