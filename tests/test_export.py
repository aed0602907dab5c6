"""Portable weights (``export_weights`` to .safetensors, Hugging Face's sharded layout, .pt;
``load_weights`` reading them) and inference export (torch.export, ONNX checked with
onnxruntime) on sp, 2-rank ddp and, for weights, 2-rank fsdp. One sp training run and one
2-rank run (ddp then fsdp in the same process group) serve every test."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from tiny_transformer import TinyTransformer

from framework import Trainer, TrainerArguments
from framework.checkpoint import load_weights
from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.checkpoint.safetensors_io import load_safetensors

TOKENS = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(5))
SHARD = 4000  # bytes: the tiny transformer (~28 KB) becomes several shards


def arguments(backend: str, out: str) -> TrainerArguments:
    checkpoints = DefaultCheckpointerArguments(save_dir=os.path.join(out, "checkpoints"), keep_best_n=1, keep_last_n=1)
    return TrainerArguments(
        epochs=3,
        train_batch_size=16,
        backend=backend,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=out,
        sanity_val_steps=0,
        checkpointer_args=checkpoints,
    )


def state_of(module: torch.nn.Module) -> dict:
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)  # safetensors orders a file's keys itself
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sp"))
    trainer = Trainer(TinyTransformer(), arguments("sp", out))
    trainer.train()
    return trainer, out


def test_safetensors_single_file_and_sharded_index_hold_the_modules_own_keys(trained, tmp_path):
    trainer, _ = trained
    expected = state_of(trainer.module)
    single = trainer.export_weights(str(tmp_path / "model.safetensors"))
    assert single.endswith("model.safetensors")
    assert_same_weights(load_safetensors(single)[1], expected)

    index = trainer.export_weights(str(tmp_path / "sharded" / "model.safetensors"), max_shard_size=SHARD)
    assert index.endswith("model.safetensors.index.json")
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as handle:
        layout = json.load(handle)
    shards = sorted(set(layout["weight_map"].values()))
    assert len(shards) > 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(os.listdir(tmp_path / "sharded")) == sorted([*shards, "model.safetensors.index.json"])
    assert layout["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for shard in shards:  # each shard within the limit unless one tensor alone is larger
        tensors = load_safetensors(str(tmp_path / "sharded" / shard))[1]
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= SHARD

    fresh = TinyTransformer(seed=1)
    assert load_weights(fresh, index) == index
    assert_same_weights(state_of(fresh), expected)
    fresh = TinyTransformer(seed=1)
    load_weights(fresh, single)
    assert_same_weights(state_of(fresh), expected)


def test_pt_export_and_best_checkpoint_export_load_back(trained, tmp_path):
    trainer, out = trained
    best = TinyTransformer(seed=1)
    load_weights(best, os.path.join(out, "checkpoints"), step="best")
    path = trainer.export_weights(str(tmp_path / "best.safetensors"), checkpoint="best")
    assert_same_weights(load_safetensors(path)[1], state_of(best))

    fresh = TinyTransformer(seed=2)
    load_weights(fresh, trainer.export_weights(str(tmp_path / "model.pt")))
    assert_same_weights(state_of(fresh), state_of(trainer.module))
    with pytest.raises(ValueError, match=r"must end in '\.safetensors' or '\.pt'"):
        trainer.export_weights(str(tmp_path / "model.bin"))
    with pytest.raises(ValueError, match=r"max_shard_size='lots' is invalid"):
        trainer.export_weights(str(tmp_path / "model.safetensors"), max_shard_size="lots")


def test_torch_export_program_matches_eager(trained, tmp_path):
    trainer, _ = trained
    path = trainer.export(str(tmp_path / "model.pt2"), (TOKENS,), checkpoint="last")
    trainer.module.eval()
    with torch.no_grad():
        eager = trainer.module(TOKENS)
    exported = torch.export.load(path).module()(TOKENS)
    torch.testing.assert_close(exported, eager, atol=1e-5, rtol=1e-5)


def test_onnx_export_matches_eager_in_onnxruntime(trained, tmp_path):
    import onnxruntime

    trainer, _ = trained
    path = trainer.export(str(tmp_path / "model.onnx"), (TOKENS,), format="onnx")
    trainer.module.eval()
    with torch.no_grad():
        eager = trainer.module(TOKENS)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: TOKENS.numpy()})
    torch.testing.assert_close(torch.from_numpy(output), eager, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"export\(format='tflite'\) is unknown; allowed: 'torch\.export', 'onnx'"):
        trainer.export(str(tmp_path / "model.tflite"), (TOKENS,), format="tflite")


def two_ranks(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {}
    ddp = Trainer(TinyTransformer(), arguments("ddp", os.path.join(out, "ddp")))
    ddp.train()
    results["ddp_weights"] = ddp.export_weights(os.path.join(out, "ddp.safetensors"), max_shard_size=SHARD)
    results["ddp_state"] = state_of(ddp.module)
    results["ddp_program"] = ddp.export(os.path.join(out, "ddp.pt2"), (TOKENS,))
    fsdp = Trainer(TinyTransformer(), arguments("fsdp", os.path.join(out, "fsdp")))
    fsdp.train()
    results["fsdp_weights"] = fsdp.export_weights(os.path.join(out, "fsdp.safetensors"))
    gathered = fsdp.backend.strategy.unsharded(fsdp.module.state_dict())  # collective: every rank gathers the shards
    results["fsdp_state"] = {key: value.detach().clone() for key, value in gathered.items()}
    results["files"] = sorted(os.listdir(out))
    fsdp.close()
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_and_fsdp_export_full_weights_from_rank_zero(tmp_path):
    out = str(tmp_path)
    results = run_ranks(two_ranks, timeout=400, out=out)
    assert results[0]["ddp_weights"] == results[1]["ddp_weights"]  # every rank learns where it went
    assert results[0]["ddp_weights"].endswith("ddp.safetensors.index.json")
    assert_same_weights(load_safetensors(results[0]["ddp_weights"])[1], results[0]["ddp_state"])
    program = torch.export.load(results[0]["ddp_program"]).module()
    plain = TinyTransformer(seed=1)
    plain.load_state_dict(results[0]["ddp_state"])
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(program(TOKENS), plain(TOKENS), atol=1e-5, rtol=1e-5)

    fresh = TinyTransformer(seed=1)  # fsdp: the gathered weights under the plain module's own keys
    load_weights(fresh, results[0]["fsdp_weights"])
    assert_same_weights(state_of(fresh), results[0]["fsdp_state"])
    assert not torch.equal(fresh.head.weight, TinyTransformer(seed=0).head.weight)  # trained, not the initial weights
    assert [name for name in results[0]["files"] if name.startswith("fsdp")] == ["fsdp", "fsdp.safetensors"]


KILLING_EXPORT = """
import os, signal, sys
import torch
from tiny_transformer import TinyTransformer
from framework.checkpoint import safetensors_io, storage
where, after = sys.argv[1], int(sys.argv[2])
torch.manual_seed(123)  # other weights than the export already there
written = []
original_write, original_mv = storage.write_atomically, None

def write_then_die(fs, path, obj, serializer=torch.save):
    original_write(fs, path, obj, serializer)
    written.append(path)
    if "-of-" in path and len(written) == after:
        os.kill(os.getpid(), signal.SIGKILL)  # between shards

storage.write_atomically = write_then_die
if after < 0:  # die after the first shard moved into place
    filesystem = type(storage.resolve(where)[0])
    original_mv = filesystem.mv
    def mv_then_die(self, *args, **kwargs):
        original_mv(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    filesystem.mv = mv_then_die
safetensors_io.save_safetensors(TinyTransformer().state_dict(), where, max_shard_size=%d)
"""


def export_killed(where: str, after: int) -> int:
    """A real process exporting other weights to ``where``, SIGKILLed after its ``after``-th staged
    shard (``after=-1``: after its first shard moved into place); returns its exit status."""
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    script = KILLING_EXPORT % SHARD
    return subprocess.run([sys.executable, "-c", script, where, str(after)], env=env, timeout=120).returncode


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last ^ 0x40]))


def test_an_export_killed_between_shards_leaves_the_previous_one_whole_and_a_flipped_byte_is_refused(trained, tmp_path):
    from backends.checkpoint_io import CorruptCheckpoint

    trainer, _ = trained
    where = str(tmp_path / "model.safetensors")
    index = trainer.export_weights(where, max_shard_size=SHARD)
    expected = state_of(trainer.module)
    assert export_killed(where, after=2) == -9  # SIGKILLed with two of its shards written
    module = TinyTransformer()
    load_weights(module, index)  # the previous export, whole: not a mix of old and new shards
    assert_same_weights(state_of(module), expected)

    assert export_killed(where, after=-1) == -9  # killed while moving its shards into place
    with pytest.raises(FileNotFoundError):  # no export rather than a mixed one
        load_weights(TinyTransformer(), index)
    trainer.export_weights(where, max_shard_size=SHARD)  # a new export cleans up what the killed ones left
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
    load_weights(module, index)
    assert_same_weights(state_of(module), expected)

    with open(tmp_path / "model.safetensors.index.json") as handle:
        shards = sorted(set(json.load(handle)["weight_map"].values()))
    flip_last_byte(str(tmp_path / shards[-1]))  # a weight's byte, as a disk or a copy may flip it
    with pytest.raises(CorruptCheckpoint, match=f"{shards[-1]}.*does not match the SHA-256"):
        load_weights(TinyTransformer(), index)
    trainer.export_weights(str(tmp_path / "single.safetensors"))
    flip_last_byte(str(tmp_path / "single.safetensors"))
    with pytest.raises(CorruptCheckpoint, match="do not match the SHA-256 in its header"):
        load_weights(TinyTransformer(), str(tmp_path / "single.safetensors"))


def test_a_safetensors_file_exported_before_headers_were_digested_still_loads_and_its_bytes_are_checked(tmp_path):
    """A file with only ``__metadata__["sha256"]`` (of the tensor bytes: written before ``sha256_with_header``)."""
    import hashlib

    from safetensors.torch import save

    from backends.checkpoint_io import CorruptCheckpoint

    expected = state_of(TinyTransformer())
    body = save(expected)[8 + int.from_bytes(save(expected)[:8], "little") :]
    old = save(expected, metadata={"format": "pt", "sha256": hashlib.sha256(body).hexdigest()})
    path = tmp_path / "old.safetensors"
    path.write_bytes(old)
    module = TinyTransformer(seed=1)  # other initial weights
    assert not torch.equal(state_of(module)["head.weight"], expected["head.weight"])
    load_weights(module, str(path))
    assert_same_weights(state_of(module), expected)
    path.write_bytes(old[:-1] + bytes([old[-1] ^ 1]))
    with pytest.raises(CorruptCheckpoint, match="its tensor bytes do not match the SHA-256 in its header"):
        load_weights(TinyTransformer(), str(path))
