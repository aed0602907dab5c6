"""The pipeline's arguments and refusals, in one process: ``pipeline_parallel_size`` and
``pipeline_schedule`` checked when the arguments are built, taken only by the fsdp and model-parallel
backends, a size that does not divide the world refused at setup, and what a schedule cannot train
(``framework/loop/steps/pipeline.py``) refused before step 1, each naming why and what to use.

Faults caught: a bad size or schedule accepted until deep in torch (check removed from
``TrainerArguments``); an sp backend silently ignoring ``pipeline_parallel_size`` (option not declared
by fsdp only); a world size the stages do not divide accepted (``check_pipeline_layout`` removed);
manual optimization, LBFGS, TBPTT, ``gpu_batch_size_limit="auto"`` or a module without
``pipeline_inputs``/``pipeline_loss`` reaching the schedule (each refusal removed).
"""

from types import SimpleNamespace

import pytest
import torch
from pipeline_llama import PipelineLlama

from toy import ToyModule, toy_args

from backends.strategies.fsdp import FSDP
from backends.strategies.model_parallel import ModelParallel
from framework import Trainer, TrainerArguments
from framework.loop.steps.pipeline import check_pipeline_module


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_pipeline_size_is_refused_naming_it(bad):
    with pytest.raises((ValueError, TypeError), match="pipeline_parallel_size"):
        TrainerArguments(pipeline_parallel_size=bad)


@pytest.mark.parametrize("bad", ["Interleaved1F1B", "ZBVZeroBubble", "nope"])
def test_schedules_other_than_1f1b_and_gpipe_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match=f"pipeline_schedule={bad!r}.*'1F1B' or 'GPipe'"):
        TrainerArguments(pipeline_schedule=bad)
    with pytest.raises(ValueError, match=f"pipeline_schedule={bad!r}"):
        FSDP(use_gpu=False, pipeline_schedule=bad)


def test_schedule_names_are_case_insensitive_and_reach_the_strategies():
    args = TrainerArguments(backend="model-parallel", pipeline_parallel_size=2, pipeline_schedule="gpipe")
    strategy = ModelParallel.from_arguments(args)
    assert (strategy.pipeline_parallel_size, strategy.pipeline_schedule) == (2, "gpipe")
    assert FSDP.from_arguments(SimpleNamespace(pipeline_parallel_size=4)).options["pipeline_parallel_size"] == 4


def test_a_backend_without_pipelines_refuses_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 does not apply.*fsdp and model-parallel"):
        Trainer(ToyModule(), toy_args(tmp_path, backend="sp", pipeline_parallel_size=2))


def test_more_stages_than_processes_are_refused_at_setup(tmp_path):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 does not divide the world size 1; allowed: one of \[1\]"):
        Trainer(PipelineLlama(), toy_args(tmp_path, backend="fsdp", pipeline_parallel_size=2))


class ManualLlama(PipelineLlama):
    automatic_optimization = False


@pytest.mark.parametrize(
    "module, args, automatic, closure, named",
    [
        (ToyModule(), None, True, False, r"does not define \['pipeline_inputs', 'pipeline_loss'\]"),
        (PipelineLlama(), None, False, False, "manual optimization"),
        (PipelineLlama(), None, True, True, "LBFGS"),
        (PipelineLlama(), SimpleNamespace(tbptt_steps=4), True, False, "tbptt_steps"),
        (PipelineLlama(), SimpleNamespace(gpu_batch_size_limit="auto"), True, False, 'gpu_batch_size_limit="auto"'),
    ],
)
def test_what_a_schedule_cannot_train_is_refused_naming_why(module, args, automatic, closure, named):
    with pytest.raises(ValueError, match=named) as refused:
        check_pipeline_module(module, args, automatic, closure)
    assert "pipeline_parallel_size=1" in str(refused.value)


def test_a_module_with_both_methods_and_automatic_optimization_is_accepted():
    check_pipeline_module(PipelineLlama(), SimpleNamespace(tbptt_steps=None, gpu_batch_size_limit=2), True, False)
    assert isinstance(PipelineLlama().layers, torch.nn.ModuleDict)
