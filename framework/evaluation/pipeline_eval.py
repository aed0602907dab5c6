"""Evaluation under a pipeline: each batch through the schedule's forward-only ``eval``.

Under ``pipeline_parallel_size > 1`` no rank holds the whole model, so ``val_step`` / ``test_step``
(which call the module's ``forward`` on a batch) cannot run. Instead each batch goes through
``pipeline_inputs(batch)``, the stages' forwards (``schedule.eval``) and ``pipeline_loss`` on the last
stage; that loss, broadcast over the pipeline, is the step's ``val_loss`` / ``test_loss`` (weighted by
the batch's size, as a returned loss is); what ``pipeline_loss`` logs with ``self.log`` is not recorded
during evaluation (training's values would otherwise get validation's). Prediction has no loss to
return and is refused.
"""

from typing import Any, Callable, Optional

import torch

from framework.loop.stage import Stage
from framework.loop.steps.pipeline import PipelineLoss, stage_losses


def pipeline_evaluation(module: Any, backend: Any) -> Optional[Callable[..., Any]]:
    """``evaluate(stage, global_step, batch, device) -> loss`` under a pipeline; None without one.

    Example:
        >>> from backends import SingleProcess, TrainerBackend
        >>> pipeline_evaluation(object(), TrainerBackend(SingleProcess())) is None
        True
    """
    strategy = backend.strategy
    if not getattr(strategy, "pipelined", False):
        return None

    def evaluate(stage: Stage, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        if stage is Stage.PREDICT:
            raise ValueError(
                "predict() under pipeline_parallel_size > 1 is not supported: predict_step needs the whole model's "
                "outputs on one rank; predict with pipeline_parallel_size=1 (the checkpoint reshards to it)"
            )
        inputs, target = module.pipeline_inputs(batch)
        inputs = tuple(inputs)
        runner = strategy.pipeline_runner(1, PipelineLoss(module, quiet=True), inputs)
        losses = backend.forward(runner.evaluate, inputs, target)
        return strategy.broadcast_from_last_stage(stage_losses(losses, 1, device))[0]

    return evaluate
