"""EMA, true bf16 and activation checkpointing on 2 real gloo ranks under ``ddp`` and ``fsdp``.

One 2-rank run (``scenarios``) trains every case in the same process group, so the features
share its start-up cost; the single-process tests are in ``test_weight_averaging.py``,
``test_true_bf16.py`` and ``test_activation_checkpointing.py``.
"""

import math
import os

import pytest
import torch.distributed as dist

from distributed import run_ranks
from tiny_transformer import TinyTransformer

from framework import Trainer, TrainerArguments
from framework.callbacks import EMA

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def arguments(backend: str, out: str, **overrides) -> TrainerArguments:
    """1 epoch of 4 steps, global batch 16 in micro-batches of 4 (accumulation 2 on 2 ranks)."""
    args = TrainerArguments(
        epochs=1,
        train_batch_size=16,
        gpu_batch_size_limit=4,
        backend=backend,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=out,
        sanity_val_steps=0,
        log_every_n_steps=2,
        **overrides,
    )
    args.checkpointer_args.save_dir = os.path.join(out, "checkpoints")
    return args


def full(trainer: Trainer, state: dict) -> dict:
    return {name: tensor.detach().float().clone() for name, tensor in trainer.backend.strategy.unsharded(state).items()}


def local_numel(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors)


def scenarios(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for backend in ("ddp", "fsdp"):
        ema = EMA(decay=0.9)
        trainer = Trainer(TinyTransformer(), arguments(backend, os.path.join(out, backend)), callbacks=[ema])
        trainer.train()
        results[backend] = full(trainer, trainer.module.state_dict())
        results[f"{backend} ema"] = full(trainer, ema.averaged_state_dict())
        results[f"{backend} val_loss"] = trainer.history.latest("val_loss")
        results[f"{backend} losses"] = trainer.history.values("train_loss")
        results[f"{backend} ema numel"] = (local_numel(ema.module.parameters()), sum(p.numel() for p in ema.module.parameters()))

        checkpointed = Trainer(
            TinyTransformer(), arguments(backend, os.path.join(out, f"{backend}-ac"), activation_checkpointing=True)
        )
        checkpointed.train()
        results[f"{backend} ac"] = full(checkpointed, checkpointed.module.state_dict())

        bf16 = Trainer(TinyTransformer(), arguments(f"{backend}-bf16", os.path.join(out, f"{backend}-bf16")))
        bf16.train()
        results[f"{backend}-bf16"] = full(bf16, bf16.module.state_dict())
        results[f"{backend}-bf16 losses"] = bf16.history.values("train_loss")
        state = [v for s in bf16.optimizers[0].state.values() for v in s.values() if v.dim()]
        results[f"{backend}-bf16 dtypes"] = sorted({str(t.dtype) for t in [*bf16.module.parameters(), *state]})

    # fsdp: stopped after 2 steps, resumed from the sharded checkpoint with the EMA's shards
    stopped = os.path.join(out, "fsdp-stopped")
    Trainer(TinyTransformer(), arguments("fsdp", stopped, max_steps=2), callbacks=[EMA(decay=0.9)]).train()
    args = arguments("fsdp", stopped)
    args.checkpointer_args.resume = "auto"
    ema = EMA(decay=0.9)
    resumed = Trainer(TinyTransformer(), args, callbacks=[ema])
    resumed.train()
    results["fsdp resumed ema"] = full(resumed, ema.averaged_state_dict())
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(scenarios, out=str(tmp_path_factory.mktemp("memory")), timeout=600)


def max_difference(first: dict, second: dict) -> float:
    return max((first[name] - second[name]).abs().max().item() for name in first)


def test_ema_is_identical_on_every_ddp_rank_equal_under_fsdp_sharded_and_resumed_exactly(runs):
    first, second = runs
    assert max_difference(first["ddp ema"], second["ddp ema"]) == 0
    assert max_difference(first["ddp ema"], first["ddp"]) > 1e-3  # an average, not the weights
    assert max_difference(first["fsdp ema"], first["ddp ema"]) <= 1e-5
    assert first["fsdp val_loss"] == pytest.approx(first["ddp val_loss"], rel=1e-5)
    local, total = first["fsdp ema numel"]
    assert local < 0.6 * total  # each rank averages its own shards
    assert first["ddp ema numel"][0] == first["ddp ema numel"][1]
    assert max_difference(first["fsdp resumed ema"], first["fsdp ema"]) == 0


def test_activation_checkpointing_gives_the_same_weights_on_ddp_and_fsdp(runs):
    first, _ = runs
    assert max_difference(first["ddp ac"], first["ddp"]) <= 1e-6
    assert max_difference(first["fsdp ac"], first["fsdp"]) <= 1e-6


def test_ddp_bf16_and_fsdp_bf16_train_in_bf16_without_master_weights(runs):
    first, _ = runs
    for backend in ("ddp-bf16", "fsdp-bf16"):
        assert first[f"{backend} dtypes"] == ["torch.bfloat16"]
        losses, fp32_losses = first[f"{backend} losses"], first[f"{backend.split('-')[0]} losses"]
        assert len(losses) == len(fp32_losses) == 2 and all(math.isfinite(loss) for loss in losses)
        assert losses == pytest.approx(fp32_losses, abs=0.05)  # the same training, rounded to bf16
        assert max_difference(first[backend], first[backend.split("-")[0]]) < 0.1  # bf16 rounding of the same run
    assert max_difference(first["ddp-bf16"], first["fsdp-bf16"]) < 0.05
