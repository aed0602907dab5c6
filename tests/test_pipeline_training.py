"""Pipeline parallelism end to end (``pipeline_parallel_size=2``, ``backends/strategies/pipeline.py``,
``framework/loop/steps/pipeline.py``): a torchtitan-layout llama (embeddings, an ``nn.ModuleDict`` of
4 blocks, norm, head) trains on 2 real gloo ranks, one stage each, with 4 micro-batches per step
through 1F1B and clipping that bites, and ends within 1e-5 of ``sp`` in every weight and every logged
loss (train and validation); a run stopped at a checkpoint resumes to the same weights bitwise, and
the pipeline's checkpoint reshards to one process (``sp``).

Faults each test catches: clipping by each stage's own norm; the loss logged from stage 0 (the loss
exists on the last stage only); pp peers reading different batches; the last micro-batch's loss not
divided by the cycle; a stage resuming another stage's optimizer state.
"""

import os
from typing import Any, Dict

import pytest
import torch
from pipeline_llama import LoggingLlama, MetaLlama, PipelineLlama, full_weights, losses

from distributed import run_ranks
from toy import toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.export import export_weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, MAX_NORM = 4, 0.3
TRAIN = dict(train_batch_size=8, gpu_batch_size_limit=2, max_steps=STEPS, clip_grads=True, max_grad_norm=MAX_NORM)
TRAIN.update(log_every_n_steps=1, track_grad_norm=True, max_val_steps_per_epoch=2, val_batch_size=8, val_every_n_steps=2)


def train(out: str, model: type = PipelineLlama, **overrides: Any) -> Dict[str, Any]:
    module = model()
    trainer = Trainer(module, toy_args(out, **{**TRAIN, **overrides}))
    trainer.train()
    history = trainer.history
    return {
        "weights": full_weights(module),
        "train_loss": losses(history),
        "val_loss": losses(history, "val_loss"),
        "grad_norm": losses(history, "grad_norm"),
        "token_loss": losses(history, "token_loss") + losses(history, "token_loss_epoch"),
    }


def pipelines(rank: int, out: str) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for backend, schedule in (("fsdp", "1F1B"), ("model-parallel", "GPipe")):
        pipeline = dict(pipeline_parallel_size=2, pipeline_schedule=schedule)
        results[backend] = train(os.path.join(out, backend), backend=backend, **pipeline)
    module = PipelineLlama()
    trainer = Trainer(module, toy_args(os.path.join(out, "export"), backend="fsdp", pipeline_parallel_size=2, max_steps=1))
    trainer.train()
    results["exported"] = os.path.join(out, "export", "weights.pt")
    export_weights(trainer, results["exported"])
    logged = dict(max_train_steps_per_epoch=2, sanity_val_steps=2)
    results["logged"] = train(os.path.join(out, "logged"), LoggingLlama, backend="fsdp", pipeline_parallel_size=2, **logged)
    results["meta"] = train(os.path.join(out, "meta"), MetaLlama, backend="fsdp", pipeline_parallel_size=2, max_steps=1)
    saves = os.path.join(out, "checkpoints")
    at_end = DefaultCheckpointerArguments(save_dir=saves, period=0, save_at_end=True)
    train(os.path.join(out, "stopped"), backend="fsdp", pipeline_parallel_size=2, max_steps=2, checkpointer_args=at_end)
    resume = DefaultCheckpointerArguments(period=0, save_at_end=False, load_dir=saves)
    results["resumed"] = train(os.path.join(out, "resumed"), backend="fsdp", pipeline_parallel_size=2, checkpointer_args=resume)
    results["saves"] = saves
    results["as_fsdp"] = train(os.path.join(out, "as-fsdp"), backend="fsdp", checkpointer_args=resume)  # pp 2 -> pp 1 (dp 2)
    flat = os.path.join(out, "flat-checkpoints")
    flat_end = DefaultCheckpointerArguments(save_dir=flat, period=0, save_at_end=True)
    train(os.path.join(out, "flat"), backend="fsdp", max_steps=2, checkpointer_args=flat_end)
    from_flat = DefaultCheckpointerArguments(period=0, save_at_end=False, load_dir=flat)
    results["from_fsdp"] = train(
        os.path.join(out, "from-fsdp"), backend="fsdp", pipeline_parallel_size=2, checkpointer_args=from_flat
    )
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    reference = train(str(root / "sp"))
    reference["logged"] = train(str(root / "sp-logged"), LoggingLlama, max_train_steps_per_epoch=2, sanity_val_steps=2)
    reference["meta"] = train(str(root / "sp-meta"), MetaLlama, max_steps=1)
    ranks = run_ranks(pipelines, timeout=400, out=str(root))
    return reference, ranks, root


def close(weights: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    return max(float((tensor - reference[name]).abs().max()) for name, tensor in weights.items())


@pytest.mark.parametrize("backend", ["fsdp", "model-parallel"])
def test_pipeline_of_two_stages_trains_as_one_process(runs, backend):
    reference, ranks, _ = runs
    assert max(reference["grad_norm"]) > MAX_NORM  # clipping bites
    held = [set(rank[backend]["weights"]) for rank in ranks]
    assert held[0] | held[1] == set(reference["weights"]) and not held[0] & held[1]  # each stage its own parameters
    assert "tok_embeddings.weight" in held[0] and "output.weight" in held[1]
    for rank in ranks:
        result = rank[backend]
        assert close(result["weights"], reference["weights"]) < 1e-5
        for name in ("train_loss", "val_loss", "grad_norm"):
            assert len(result[name]) == len(reference[name]) > 0, name
            assert max(abs(a - b) for a, b in zip(result[name], reference[name])) < 1e-5, name


def test_pipeline_resumes_its_checkpoint_bitwise_and_reshards_to_one_process(runs, tmp_path):
    reference, ranks, _ = runs
    for rank in ranks:
        uninterrupted, resumed = rank["fsdp"]["weights"], rank["resumed"]["weights"]
        assert all(torch.equal(resumed[name], tensor) for name, tensor in uninterrupted.items())
    resume = DefaultCheckpointerArguments(period=0, save_at_end=False, load_dir=ranks[0]["saves"])
    as_sp = train(str(tmp_path / "as-sp"), checkpointer_args=resume)
    assert close(as_sp["weights"], reference["weights"]) < 1e-5


def test_a_model_built_on_meta_gets_on_each_stage_the_values_one_process_draws(runs):
    """Fault: each stage drawing its layers in its own order (stage 1's blocks would get stage 0's values)."""
    reference, ranks, _ = runs
    for rank in ranks:
        assert close(rank["meta"]["weights"], reference["meta"]["weights"]) < 1e-5
        assert max(abs(a - b) for a, b in zip(rank["meta"]["train_loss"], reference["meta"]["train_loss"])) < 1e-5


def test_what_pipeline_loss_logs_on_the_last_stage_reaches_every_rank(runs):
    """Fault: metrics reduced on the last stage only (rank zero, on stage 0, would record none of them).
    The run starts with the sanity validation (through the schedule's eval), which records nothing."""
    reference, ranks, _ = runs
    expected = reference["logged"]["token_loss"]
    assert len(expected) == 3  # two steps and the epoch
    for rank in ranks:
        found = rank["logged"]["token_loss"]
        assert len(found) == len(expected) and max(abs(a - b) for a, b in zip(found, expected)) < 1e-5, (found, expected)


def test_a_pipeline_checkpoint_reshards_to_fsdp_without_pipeline_and_back(runs):
    """pp 2 (dp 1) -> fsdp pp 1 (dp 2), and fsdp pp 1 -> pp 2, each continued to the end. Fault: optimizer
    state keyed by position (each stage's "parameter 0" another parameter), or a stage refusing the
    other stages' names."""
    reference, ranks, _ = runs
    for rank in ranks:
        assert close(rank["as_fsdp"]["weights"], reference["weights"]) < 1e-5
        assert close(rank["from_fsdp"]["weights"], reference["weights"]) < 1e-5
        assert len(rank["from_fsdp"]["weights"]) < len(reference["weights"])  # a stage


def test_export_weights_gathers_every_stage(runs, tmp_path):
    """Fault: each stage's ``state_dict()`` exported alone (rank zero would write stage 0's half)."""
    _, ranks, _ = runs
    module = PipelineLlama()
    Trainer(module, toy_args(tmp_path, max_steps=1)).train()
    exported = torch.load(ranks[0]["exported"], weights_only=True)["model"]
    whole = module.state_dict()
    assert list(exported) == list(whole)
    assert max(float((exported[name] - tensor).abs().max()) for name, tensor in whole.items()) < 1e-5
