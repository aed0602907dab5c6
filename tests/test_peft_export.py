"""``export_pretrained`` of a ``peft`` (LoRA) model: the merged base model loads with
``from_pretrained`` and the adapters with ``PeftModel.from_pretrained``, with no missing or
unexpected keys and the trained model's logits, on sp, 2-rank ddp and 2-rank fsdp; what cannot
be exported is refused before anything is written. A tiny Llama built from a config: nothing is
downloaded (``HF_HUB_OFFLINE=1``)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import peft  # the dev extra installs it
import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tiny_llama import TINY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM

from distributed import run_ranks
from toy import toy_args

from framework import Trainer
from framework.integrations.transformers import PretrainedModule

TOKENS = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
CONFIG = TINY_LLAMA


def stack(examples):
    return {key: torch.stack([example[key] for example in examples]) for key in examples[0]}


def base_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def lora(model: torch.nn.Module, adapter: str = "default") -> PeftModel:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, config, adapter_name=adapter)


def lora_module() -> PretrainedModule:
    data = [{"input_ids": row, "labels": row} for row in TOKENS]
    return PretrainedModule(lora(base_llama()), data, data[:8], collate_fn=stack, learning_rate=3e-2)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS[:4]).logits


def check_export(merged_dir: str, adapters_dir: str, trained: torch.Tensor) -> None:
    """Both exports load with no missing or unexpected keys and give ``trained`` (the trained PEFT model's logits)."""
    merged, info = LlamaForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged), trained, rtol=1e-5, atol=1e-5)
    assert sorted(os.listdir(adapters_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    adapted = PeftModel.from_pretrained(base_llama(), adapters_dir)  # the frozen base as it was built
    torch.testing.assert_close(logits(adapted), trained, rtol=1e-5, atol=1e-5)
    assert (logits(base_llama()) - trained).abs().max() > 1e-3  # the adapter changed the model: it was exported


def test_a_lora_model_trained_on_sp_exports_merged_and_as_peft_adapters(tmp_path):
    """Kills: the LoRA-layout keys written as the model's (4 missing, 12 unexpected keys in from_pretrained),
    a merge into the trained model itself (its logits change), adapter files PEFT cannot load or that hold
    more than PEFT's own save (the base weights under the adapter's keys)."""
    module = lora_module()
    trainer = Trainer(module, toy_args(tmp_path, train_batch_size=8))
    trainer.train()
    trained = logits(module.model)
    merged_dir = trainer.export_pretrained(str(tmp_path / "merged"))
    adapters_dir = trainer.export_pretrained(str(tmp_path / "adapters"), peft_layout="adapters")
    assert torch.equal(logits(module.model), trained)  # the export merged a copy, the trained model is as it was
    assert sorted(os.listdir(merged_dir)) == ["config.json", "generation_config.json", "model.safetensors"]
    check_export(merged_dir, adapters_dir, trained)
    named = trainer.export_pretrained(str(tmp_path / "named"), attribute="model")  # the attribute holding the peft model
    assert (
        load_file(os.path.join(named, "model.safetensors")).keys()
        == load_file(os.path.join(merged_dir, "model.safetensors")).keys()
    )
    module.model.save_pretrained(str(tmp_path / "peft-own"))  # PEFT's own save, possible on one process
    own = load_file(str(tmp_path / "peft-own" / "adapter_model.safetensors"))
    written = load_file(os.path.join(adapters_dir, "adapter_model.safetensors"))
    assert sorted(written) == sorted(own) and all(torch.equal(written[key], own[key]) for key in own)  # adapters only


def test_what_cannot_be_exported_is_refused_before_anything_is_written(tmp_path):
    """Kills: a layout name passed through unchecked, several adapters exported as one, LoRA layers
    injected without a PeftModel written with their LoRA keys, and 'adapters' asked of a plain model."""
    module = lora_module()
    trainer = Trainer(module, toy_args(tmp_path, train_batch_size=8, epochs=1, max_train_steps_per_epoch=1))
    with pytest.raises(ValueError, match=r"peft_layout='lora' is invalid; allowed: 'merged', 'adapters'"):
        trainer.export_pretrained(str(tmp_path / "bad"), peft_layout="lora")
    module.model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=r"holds the adapters 'default', 'second'; it exports one"):
        trainer.export_pretrained(str(tmp_path / "bad"))
    trainer.close()

    injected = peft.inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"]), base_llama())
    data = [{"input_ids": row, "labels": row} for row in TOKENS]
    trainer = Trainer(PretrainedModule(injected, data, collate_fn=stack), toy_args(tmp_path / "injected"))
    with pytest.raises(ValueError, match=r"holds PEFT adapter layers \(model.layers.0.self_attn.q_proj, ...\) outside"):
        trainer.export_pretrained(str(tmp_path / "bad"))
    trainer.close()
    trainer = Trainer(PretrainedModule(base_llama(), data, collate_fn=stack), toy_args(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"peft_layout='adapters': LlamaForCausalLM is no peft model"):
        trainer.export_pretrained(str(tmp_path / "bad"), peft_layout="adapters")
    trainer.close()
    assert not os.path.exists(tmp_path / "bad")


def two_ranks(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for backend in ("ddp", "fsdp"):
        trainer = Trainer(lora_module(), toy_args(os.path.join(out, backend), backend=backend, train_batch_size=8))
        trainer.train()
        merged = trainer.export_pretrained(os.path.join(out, f"{backend}-merged"))
        adapters = trainer.export_pretrained(os.path.join(out, f"{backend}-adapters"), peft_layout="adapters")
        state = trainer.backend.unsharded(trainer.module.model.state_dict())
        results[backend] = (merged, adapters, {key: value.detach().clone() for key, value in state.items()})
        trainer.close()
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lora_model_trained_on_two_rank_ddp_and_fsdp_exports_merged_and_as_peft_adapters(tmp_path):
    """Kills: PEFT's own save of the sharded parameters (fsdp: one rank's shard, or a crash), and an
    export of the weights before they are gathered."""
    results = run_ranks(two_ranks, timeout=400, out=str(tmp_path))
    for backend in ("ddp", "fsdp"):
        merged_dir, adapters_dir, state = results[0][backend]
        assert results[1][backend][:2] == (merged_dir, adapters_dir)
        reference = lora(base_llama())
        reference.load_state_dict(state)  # the trained weights, gathered
        check_export(merged_dir, adapters_dir, logits(reference))
