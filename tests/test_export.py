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
