"""The pipeline step: a cycle's micro-batches run through the pipeline's schedule, then one optimizer step.

Under ``pipeline_parallel_size > 1`` (``backends/strategies/pipeline.py``) each rank holds one stage.
Every stage reads the cycle's batches (pp peers read the same ones); the module's
``pipeline_inputs(batch)`` gives each batch's inputs of the first stage and target of the last, which
are joined along dim 0 and split again by the schedule into the same micro-batches. The schedule
(``1F1B`` or ``GPipe``) runs each micro-batch's forward and backward, dividing its loss by the number
of micro-batches as the automatic step does; ``pipeline_loss(outputs, target)`` runs on the last
stage. The micro-batches' losses are then broadcast from the last stage over the pipeline, so every
rank keeps, logs and checks the same losses (the divergence check, early stopping, rank zero's log).
"""

from typing import Any, Iterator, List, Tuple

import torch

from framework.loop.steps.parts import StepParts

REQUIRED = ("pipeline_inputs", "pipeline_loss")


def check_pipeline_module(module: Any, args: Any, automatic: bool, closure: bool) -> None:
    """Refuse, before step 1, what a pipeline cannot train (naming why and what to use).

    Raises:
        ValueError: a missing ``pipeline_inputs``/``pipeline_loss``, manual optimization, an LBFGS-like
            closure optimizer, ``tbptt_steps`` or ``gpu_batch_size_limit="auto"``.

    Example:
        >>> class Plain:
        ...     pass
        >>> check_pipeline_module(Plain(), None, True, False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: pipeline_parallel_size > 1 runs Plain through a pipeline schedule, but it does not define ...
    """
    name = type(module).__name__
    missing = [method for method in REQUIRED if not callable(getattr(module, method, None))]
    if missing:
        raise ValueError(
            f"pipeline_parallel_size > 1 runs {name} through a pipeline schedule, but it does not define {missing}: define "
            "pipeline_inputs(batch) -> (inputs tuple of the first stage's forward, target) and pipeline_loss(outputs, "
            "target) -> one micro-batch's loss (on the last stage), or use pipeline_parallel_size=1"
        )
    refusals = [
        (not automatic, "manual optimization (automatic_optimization = False)", "the schedule runs every backward itself"),
        (closure, "an optimizer with a closure (LBFGS)", "the closure would run the whole pipeline again per evaluation"),
        (getattr(args, "tbptt_steps", None), "tbptt_steps", "the schedule splits batches along dim 0 only"),
        (
            getattr(args, "gpu_batch_size_limit", None) == "auto",
            'gpu_batch_size_limit="auto"',
            "the probe runs one stage alone; set gpu_batch_size_limit to the micro-batch size",
        ),
    ]
    for refused, what, why in refusals:
        if refused:
            raise ValueError(
                f"pipeline_parallel_size > 1 cannot train {name} with {what}: {why}; use automatic optimization with "
                "a plain optimizer, or pipeline_parallel_size=1 (fsdp or model-parallel without a pipeline)"
            )


def joined(parts: List[Tuple[Any, Any]]) -> Tuple[Tuple[torch.Tensor, ...], Any]:
    """Each micro-batch's ``(inputs, target)`` joined along dim 0: the step's whole inputs and target."""
    first_inputs = parts[0][0]
    if not isinstance(first_inputs, (tuple, list)):
        raise TypeError(
            f"pipeline_inputs(batch) must return (a tuple of the first stage's inputs, target); got inputs of type "
            f"{type(first_inputs).__name__}"
        )
    inputs = tuple(torch.cat([pair[0][index] for pair in parts]) for index in range(len(first_inputs)))
    targets = [pair[1] for pair in parts]
    target = torch.cat(targets) if isinstance(targets[0], torch.Tensor) else targets[0]
    return inputs, target


class PipelineStep:
    """Up to ``cycle_length`` batches through the schedule, then ``on_end_backward`` and
    ``on_end_train_step`` for each micro-batch (after the schedule ran them all), the losses kept, and
    unscale, clip (over every stage), step, zero.

    Args:
        parts: what the step runs on, bound by :meth:`StepParts.bind`.

    Example:
        step = PipelineStep(parts)
        micro_batches = step.run(iter(loader), cycle_length=4)  # 4 micro-batches through 1F1B
    """

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.strategy: Any = parts.backend.strategy  # a pipelined strategy (backends/strategies/pipeline.py)
        self.loss = PipelineLoss(parts.module)

    def run(self, batches: Iterator[Any], cycle_length: int) -> int:
        """One optimizer step over up to ``cycle_length`` micro-batches; returns how many (0: the stream had ended)."""
        parts = self.parts
        step, module = parts.progress.global_steps_finished, parts.module
        pipeline_inputs: Any = getattr(module, "pipeline_inputs")  # noqa: B009 - a user method the module may lack
        collected = []
        for _ in range(cycle_length):
            batch = parts.next_batch(batches)
            if batch is None:
                break
            collected.append(pipeline_inputs(batch))
        if not collected:
            return 0
        seen = len(collected)
        inputs, target = joined(collected)
        runner = self.loss.runner = self.strategy.pipeline_runner(seen, self.loss, inputs)
        micro_losses = parts.backend.forward(runner.step, inputs, target)  # inside the precision's autocast
        losses = self.strategy.broadcast_from_last_stage(stage_losses(micro_losses, seen, parts.device))
        for index in range(seen):
            loss = losses[index]
            parts.hooks.call("on_end_backward", step, loss)
            parts.record(step, (loss,))
        parts.update(seen, seen)  # each micro-batch's loss was divided by ``seen``: the mean over those seen
        return seen


def stage_losses(micro_losses: List[torch.Tensor], micro_batches: int, device: torch.device) -> torch.Tensor:
    """The micro-batches' unscaled losses on the last stage; zeros elsewhere (the last stage's are broadcast over them)."""
    if micro_losses:
        return torch.stack([loss.detach().float() for loss in micro_losses]).to(device)
    return torch.zeros(micro_batches, device=device)


class PipelineLoss:
    """``module.pipeline_loss`` as the schedule calls it, with ``self.log`` silenced in the extra call torch
    makes to infer shapes on a stage's first step (``runner.inferring``): what it logs counts each
    micro-batch once, as on one process. ``quiet``: silenced in every call (evaluation, whose loss is
    the step's ``val_loss``).

    Example:
        loss = PipelineLoss(module)
        loss.runner = strategy.pipeline_runner(4, loss)
    """

    def __init__(self, module: Any, quiet: bool = False) -> None:
        self.module, self.quiet = module, quiet
        self.runner: Any = None

    def __call__(self, outputs: Any, target: Any) -> torch.Tensor:
        if not self.quiet and (self.runner is None or not self.runner.inferring):
            return self.module.pipeline_loss(outputs, target)
        logger = self.module._metric_logger
        self.module._metric_logger = None
        try:
            return self.module.pipeline_loss(outputs, target)
        finally:
            self.module._metric_logger = logger
