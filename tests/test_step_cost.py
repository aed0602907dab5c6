"""The framework's cost per optimizer step, counted (not timed), held to a budget.

``benchmarks/step_cost.py`` counts aten ops, host-device syncs, fresh tensors, Python calls,
collections and tracked objects per step of the framework and of the hand-written loop, long
run minus short run (set-up cancels). The budget, per optimizer step of the tiny MLP on ``sp``
(64 steps per epoch here, logging every 50 steps at the defaults):

- aten ops: one ``detach`` per step (the loss kept for the epoch mean), at most 25 ops per
  epoch (the epoch mean, read once) and at most 12 per logged step (the fold and the read-back;
  about 7 since the search for a non-finite loss runs only after a non-finite read);
- host-device syncs: one per epoch, plus one per logged step at the defaults;
- fresh tensors: at most one per step; no generation-2 collection, no growth of tracked objects;
- Python calls: at most 40 more than the raw loop's (about 610) per step (about 30 since the
  loop makes plain backend calls itself, ``TrainerBackend.is_plain``).

A change that adds work to every step fails here with the ops or calls that it added.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import step_cost  # noqa: E402

STEPS_PER_EPOCH, LOG_EVERY = 64, 50
PER_EPOCH_OPS, PER_LOG_OPS = 25, 12
PYTHON_CALLS = 40


@pytest.fixture(scope="module")
def counts():
    return step_cost.measure(samples=STEPS_PER_EPOCH * step_cost.BATCH, epochs=[1, 2])


@pytest.mark.parametrize("mode, logged", [("quiet", 0.0), ("defaults", 1.0 / LOG_EVERY)])
def test_the_framework_adds_one_detach_per_step_and_work_only_at_epoch_ends_and_log_points(counts, mode, logged):
    added = counts[f"{mode} - raw"]
    detail = f"ops added per step: {added['ops by name']}"
    assert added["ops by name"].get("detach", 0.0) <= 1.0 + PER_EPOCH_OPS / STEPS_PER_EPOCH, detail
    assert added["aten ops"] <= 1.0 + PER_EPOCH_OPS / STEPS_PER_EPOCH + PER_LOG_OPS * logged, detail
    assert added["host-device syncs"] <= 1.0 / STEPS_PER_EPOCH + logged + 1e-9, detail
    assert added["fresh tensors"] <= 1.0, detail
    assert counts["raw"]["aten ops"] > 150  # the counter saw the real step (forward, backward, AdamW)


@pytest.mark.parametrize("mode", ["quiet", "defaults"])
def test_the_framework_adds_few_python_calls_and_no_garbage_per_step(counts, mode):
    added = counts[f"{mode} - raw"]
    top = dict(list(added["calls by name"].items())[:15])
    assert added["python calls"] <= PYTHON_CALLS, f"{added['python calls']:.1f} calls added per step; most: {top}"
    assert counts["raw"]["python calls"] > 300
    assert counts[mode]["collections gen 0/1/2"][2] == 0
    assert added["tracked objects (net)"] <= 5.0, "objects the collector tracks grow with every step"


def test_each_parameters_gradient_accumulator_is_built_once_not_every_step(tmp_path):
    """Autograd frees a parameter's ``AccumulateGrad`` node with each step's graph unless
    something holds it, and rebuilding it cost about 39,000 CPU instructions a step on the
    benchmark MLP. A hook put on each node after step 1 fires in every later step only if the
    node is the one the next steps use."""
    from overhead import BenchmarkModule

    from framework import Trainer, TrainerArguments
    from framework.callbacks import Callback

    fired = []

    class HookTheAccumulators(Callback):
        def on_end_optimizer_step(self, global_step):
            if global_step == 1:
                for parameter in self.trainer.module.parameters():
                    accumulator = parameter.view_as(parameter).grad_fn.next_functions[0][0]
                    accumulator.register_hook(lambda grad_inputs, grad_outputs: fired.append(1))

    module = BenchmarkModule(step_cost.make_data(64 * step_cost.BATCH))
    args = TrainerArguments(
        epochs=1, train_batch_size=step_cost.BATCH, output_dir=str(tmp_path), max_steps=5, disable_tqdm=True, plot_metrics=False
    )
    Trainer(module, args, callbacks=[HookTheAccumulators()]).train()
    assert len(fired) == 4 * len(list(module.parameters())), "accumulators were rebuilt after step 1"
