"""``framework.integrations.transformers``: weights that ``from_pretrained`` loads (no missing or
unexpected keys, identical logits) from sp, 2-rank fsdp and ddp, and model-parallel 1x2, sharded as ``save_pretrained`` shards,
and ``PretrainedModule`` (loss from ``outputs.loss``, the Trainer's no-decay groups). Tiny models
built from configs: nothing is downloaded (``HF_HUB_OFFLINE=1``)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import torch.distributed as dist
from tiny_llama import TINY_LLAMA
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from distributed import run_ranks
from toy import toy_args

from framework import Trainer
from framework.integrations.transformers import PretrainedModule, export_pretrained, no_decay_parameter_groups

TOKENS = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))


def stack(examples):
    return {key: torch.stack([example[key] for example in examples]) for key in examples[0]}


def gpt2() -> PretrainedModule:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    data = [{"input_ids": row, "labels": row} for row in TOKENS]
    return PretrainedModule(GPT2LMHeadModel(config), data, data[:8], collate_fn=stack, learning_rate=3e-3)


def bert() -> PretrainedModule:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=2
    )
    labels = (TOKENS[:, 0] > 31).long()
    data = [{"input_ids": row, "labels": label} for row, label in zip(TOKENS, labels)]
    return PretrainedModule(BertForSequenceClassification(config), data, data, collate_fn=stack, learning_rate=3e-3)


def reload_and_compare(directory: str, module: PretrainedModule, cls) -> None:
    loaded, info = cls.from_pretrained(directory, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    module.model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=TOKENS[:4]).logits, module.model(input_ids=TOKENS[:4]).logits)


def test_gpt2_trained_on_sp_loads_with_from_pretrained_sharded_as_save_pretrained_shards(tmp_path):
    module = gpt2()
    initial = module.model.transformer.wte.weight.detach().clone()
    trainer = Trainer(module, toy_args(tmp_path, train_batch_size=8))
    trainer.train()
    assert not torch.equal(initial, module.model.transformer.wte.weight)  # trained through outputs.loss
    directory = export_pretrained(trainer, str(tmp_path / "hf"), max_shard_size="20KB")
    files = sorted(os.listdir(directory))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(files)
    shards = [name for name in files if name.startswith("model-")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    reload_and_compare(directory, module, GPT2LMHeadModel)
    assert module.model.generate(TOKENS[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_bert_classifier_loads_and_plain_export_weights_is_prefixed_by_the_attribute(tmp_path):
    module = bert()
    trainer = Trainer(module, toy_args(tmp_path, train_batch_size=8, epochs=2))
    trainer.train()
    assert trainer.validate()["accuracy"] > 0.5  # logged by val_step for a classifier
    directory = trainer.export_pretrained(str(tmp_path / "hf"))
    assert sorted(os.listdir(directory)) == ["config.json", "model.safetensors"]
    reload_and_compare(directory, module, BertForSequenceClassification)
    with pytest.warns(UserWarning, match=r"the keys carry the prefix 'model\.'.*export_pretrained"):
        trainer.export_weights(str(tmp_path / "plain.safetensors"))  # keys as the module holds them, said so
    with pytest.raises(ValueError, match=r"attribute='train_dataset' is a list, not a transformers PreTrainedModel"):
        export_pretrained(trainer, str(tmp_path / "bad"), attribute="train_dataset")


def test_no_decay_groups_are_the_trainers():
    model = bert().model
    decay, no_decay = no_decay_parameter_groups(model, 0.01)
    names = {id(p): name for name, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert not any("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def two_ranks(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for backend in ("fsdp", "ddp"):
        trainer = Trainer(gpt2(), toy_args(os.path.join(out, backend), backend=backend, train_batch_size=8))
        trainer.train()
        results[backend] = export_pretrained(trainer, os.path.join(out, f"{backend}-hf"), max_shard_size="30KB")
        state = trainer.backend.unsharded(trainer.module.model.state_dict())
        results[f"{backend}_state"] = {key: value.detach().clone() for key, value in state.items()}
        trainer.close()
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_gpt2_trained_on_two_rank_fsdp_and_ddp_loads_with_from_pretrained(tmp_path):
    results = run_ranks(two_ranks, timeout=400, out=str(tmp_path))
    for backend in ("fsdp", "ddp"):
        assert results[0][backend] == results[1][backend]
        loaded, info = GPT2LMHeadModel.from_pretrained(results[0][backend], output_loading_info=True)
        assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
        reference = gpt2().model
        reference.load_state_dict(results[0][f"{backend}_state"])
        reference.eval()
        loaded.eval()
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=TOKENS[:4]).logits, reference(input_ids=TOKENS[:4]).logits)
        assert not torch.equal(loaded.transformer.wte.weight, gpt2().model.transformer.wte.weight)


def test_validate_equals_the_transformers_trainers_evaluate_on_the_same_weights(tmp_path):
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    module = bert()
    trainer = Trainer(module, toy_args(tmp_path, val_batch_size=16))
    ours = trainer.validate()

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    hf_args = TrainingArguments(
        str(tmp_path / "hf"), per_device_eval_batch_size=16, report_to=[], use_cpu=True, disable_tqdm=True
    )
    hf = HFTrainer(model=module.model, args=hf_args, eval_dataset=module.eval_dataset, compute_metrics=accuracy)
    theirs = hf.evaluate()
    assert ours["accuracy"] == pytest.approx(theirs["eval_accuracy"], abs=1e-6)
    assert ours["val_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-6)


def test_a_port_by_the_guide_trains_the_hf_trainers_run_clipping_included(tmp_path):
    """Per-step losses of PretrainedModule (the guide's defaults) equal the transformers Trainer's
    (TrainingArguments defaults but the renamed fields) within 1e-4, with its default clipping at norm
    1.0 biting (grad norms above 1: a run without clipping is 0.08 off). Every step sees the whole
    data set, so the two samplers' orders do not matter. Mutants: PretrainedModule(max_grad_norm=None)
    as the default, or StepParts ignoring the module's max_grad_norm -> losses differ from step 3."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
    from transformers import Trainer as HFTrainer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, initializer_range=0.5, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    hf_model = copy.deepcopy(model)
    data = [{"input_ids": row, "labels": row} for row in TOKENS]
    module = PretrainedModule(model, data, collate_fn=stack, learning_rate=1e-2)
    args = toy_args(tmp_path, train_batch_size=32, epochs=6, log_every_n_steps=1, track_grad_norm=True)
    trainer = Trainer(module, args)
    trainer.train()
    ours = trainer.history.values("train_loss")
    assert min(trainer.history.values("grad_norm")) > 1.0  # clipping bites at every step

    hf_args = TrainingArguments(
        str(tmp_path / "hf"), per_device_train_batch_size=32, num_train_epochs=6, learning_rate=1e-2, logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
    )  # fmt: skip
    hf = HFTrainer(model=hf_model, args=hf_args, train_dataset=data, data_collator=stack)
    hf.train()
    theirs = [entry["loss"] for entry in hf.state.log_history if "loss" in entry]
    assert len(ours) == len(theirs) == 6
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_pretrained_module_takes_the_hf_trainers_defaults():
    # Mutants: the default max_grad_norm None; warmup_ratio ignored (-> no warmup: rates start at 1.0).
    module = bert()
    assert module.max_grad_norm == 1.0 and module.adam_betas == (0.9, 0.999) and module.adam_epsilon == 1e-8
    assert PretrainedModule(module.model, []).learning_rate == 5e-5  # TrainingArguments' (bert() passes 3e-3)
    assert PretrainedModule(module.model, [], max_grad_norm=0).max_grad_norm is None  # 0 turns it off, as in HF
    with pytest.raises(ValueError, match=r"max_grad_norm=-1.0 is invalid; allowed: a number > 0, or None or 0"):
        PretrainedModule(module.model, [], max_grad_norm=-1.0)
    with pytest.raises(ValueError, match=r"warmup_ratio=1.5 is invalid; allowed: a number in \[0, 1\]"):
        PretrainedModule(module.model, [], warmup_ratio=1.5)
    warmed = PretrainedModule(module.model, [], warmup_ratio=0.25)
    [optimizer], [schedule] = warmed.get_optimizers_schedulers(10, 2)  # 20 steps: ceil(0.25 * 20) = 5 of warmup
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"] / warmed.learning_rate)
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    [optimizer], [schedule] = PretrainedModule(module.model, [], warmup_steps=0.25).get_optimizers_schedulers(10, 2)
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-5 * 0.2)  # transformers 5's float warmup_steps


class TensorParallelLlama(PretrainedModule):
    """A tiny Llama (``nn.Linear`` layers) with Megatron's MLP split over the tensor-parallel ranks."""

    def tensor_parallel_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {}
        for index in range(len(self.model.model.layers)):
            mlp = f"model.model.layers.{index}.mlp"
            plan.update({f"{mlp}.gate_proj": ColwiseParallel(), f"{mlp}.up_proj": ColwiseParallel()})
            plan[f"{mlp}.down_proj"] = RowwiseParallel()
        return plan


def llama() -> TensorParallelLlama:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    data = [{"input_ids": row, "labels": row} for row in TOKENS]
    return TensorParallelLlama(LlamaForCausalLM(config), data, data[:8], collate_fn=stack, learning_rate=3e-3)


def model_parallel_ranks(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    trainer = Trainer(llama(), toy_args(os.path.join(out, "mp"), backend="model-parallel", train_batch_size=8))
    trainer.train()
    split = trainer.module.model.model.layers[0].mlp.down_proj.weight
    trainer.module.model.eval()
    with torch.no_grad():  # the trained model itself, its MLP split over the two ranks
        logits = trainer.module.model(input_ids=TOKENS[:4]).logits
    directory = export_pretrained(trainer, os.path.join(out, "mp-hf"), max_shard_size="30KB")
    state = trainer.backend.unsharded(trainer.module.model.state_dict())
    trainer.close()
    return {
        "directory": directory,
        "split": type(split).__name__,
        "logits": logits,
        "state": {key: value.detach().clone() for key, value in state.items()},
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_llama_trained_on_model_parallel_1x2_loads_with_from_pretrained(tmp_path):
    """Kills: an export of one rank's shard (a DTensor's local half: shapes mismatch). The weights read
    back compute what the split model computed (to rounding: a split matmul sums in another order)."""
    from transformers import LlamaForCausalLM

    results = run_ranks(model_parallel_ranks, timeout=400, out=str(tmp_path))
    assert results[0]["split"] == "DTensor" and results[0]["directory"] == results[1]["directory"]
    loaded, info = LlamaForCausalLM.from_pretrained(results[0]["directory"], output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    reference = llama().model
    untrained = {key: value.clone() for key, value in reference.state_dict().items()}
    reference.load_state_dict(results[0]["state"])
    assert not torch.equal(reference.model.layers[0].mlp.down_proj.weight, untrained["model.layers.0.mlp.down_proj.weight"])
    reference.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=TOKENS[:4]).logits, reference(input_ids=TOKENS[:4]).logits)
        logits = loaded(input_ids=TOKENS[:4]).logits
    assert torch.allclose(logits, results[0]["logits"], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0]["logits"], results[1]["logits"])


COMMON_FIELDS = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "warmup_steps", "lr_scheduler_type", "optim", "seed", "logging_steps",
    "eval_strategy", "eval_steps", "save_strategy", "save_steps", "save_total_limit", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "report_to", "fp16", "bf16", "torch_compile",
    "gradient_checkpointing", "use_cpu", "dataloader_num_workers", "ddp_find_unused_parameters",
    "resume_from_checkpoint",
)  # fmt: skip


def test_the_guide_names_a_counterpart_for_every_common_training_argument():
    # Fault: a TrainingArguments field a port needs missing from the guide (mutant: drop the
    # max_grad_norm row -> named here), or a name that is not TrainingArguments' own.
    import dataclasses
    import re

    from transformers import TrainingArguments

    names = {field.name for field in dataclasses.fields(TrainingArguments)}  # (warmup_ratio: transformers 4 only)
    assert set(COMMON_FIELDS) <= names, set(COMMON_FIELDS) - names
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "from-transformers.md")) as handle:
        rows = [line for line in handle if line.startswith("| ")]
    firsts = [row.split(" | ")[0] for row in rows]
    missing = [name for name in (*COMMON_FIELDS, "warmup_ratio") if not any(re.search(f"`{name}[`=]", c) for c in firsts)]
    assert not missing, f"docs/from-transformers.md's table lacks {missing}"


def test_a_planless_pretrained_module_under_model_parallel_is_told_of_base_model_tp_plan(tmp_path):
    # Fault: the refusal says nothing of the plan the model carries (mutant: transformers_plan_hint
    # returns "" -> no base_model_tp_plan, no prefix).
    from framework import TrainerArguments

    module = PretrainedModule(llama().model, [{"input_ids": TOKENS[0], "labels": TOKENS[0]}], collate_fn=stack)
    with pytest.raises(ValueError) as refused:
        Trainer(module, TrainerArguments(backend="model-parallel", output_dir=str(tmp_path)))
    message = str(refused.value)
    assert "neither tensor_parallel_plan()" in message and "config.base_model_tp_plan ({'layers.*.self_attn.q_proj'" in message
    assert "each name prefixed by 'model.model.'" in message and "ColwiseParallel()/RowwiseParallel()" in message
