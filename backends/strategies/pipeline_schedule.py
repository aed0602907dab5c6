"""One rank's stage of a pipeline and the schedule that runs its micro-batches (``torch.distributed.pipelining``).

The schedule's loss reproduces the framework's accumulation exactly: each micro-batch's loss is
divided by the number of micro-batches (the accumulation cycle) before its backward, and the schedule
does not scale the gradients again (``scale_grads=False``); the unscaled loss of every micro-batch is
kept (on the last stage, the only one that has it) for logging. Clipping over the stages goes through
:func:`backends.strategies.gradient_clipping.clip_gradients` with ``pipeline_group``.

Only single-stage schedules (one stage per rank: ``GPipe``, ``1F1B``) are built so far; the
interleaved and V schedules need several stages per rank and are refused by name.

Example:
    runner = PipelineRunner(stage_module, stage_index=rank, num_stages=2, device=torch.device("cpu"),
                            group=pp_group, schedule="1F1B", micro_batches=4, loss=cross_entropy)
    losses = runner.step((tokens,), target)  # the 4 micro-batches' losses on the last stage, [] elsewhere
"""

from typing import Any, Callable, List, Optional, Sequence, Type

import torch

DEFAULT_SCHEDULE = "1F1B"


def schedule_class(name: str) -> Type[Any]:
    """torch's schedule class named ``name`` (case-insensitive), if it runs one stage per rank.

    Raises:
        ValueError: ``name`` is not one of torch's schedules, or needs several stages per rank (naming
            the schedules allowed).

    Example:
        >>> schedule_class("gpipe").__name__
        'ScheduleGPipe'
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    single = ["GPipe", "1F1B"]
    try:
        found = get_schedule_class(name) if isinstance(name, str) else None
    except ValueError:
        found = None
    if found is None:
        raise ValueError(f"pipeline_schedule={name!r} is not one of torch's pipeline schedules; allowed: {single}")
    if not issubclass(found, PipelineScheduleSingle) or found is PipelineScheduleSingle:
        raise ValueError(
            f"pipeline_schedule={name!r} runs several stages on each rank (interleaved and V schedules), which this "
            f"framework does not build yet; allowed: {single}"
        )
    return found


class PipelineRunner:
    """This rank's stage (a model cut by :func:`~backends.strategies.pipeline_stages.keep_stage`) and its schedule.

    Args:
        stage_module: the parts of the model this rank holds (``forward`` runs them).
        stage_index / num_stages: its place in the pipeline.
        device: where the stage computes.
        group: the pipeline's process group (one rank per stage, in stage order).
        schedule: torch's schedule name (see :func:`schedule_class`).
        micro_batches: micro-batches per step (the accumulation cycle); the batch of a step splits into them.
        loss: ``loss(outputs, target)`` of one micro-batch, on the last stage.

    Example:
        runner = PipelineRunner(stage, 1, 2, torch.device("cpu"), group, "GPipe", micro_batches=4, loss=loss_fn)
        runner.step((), target)  # the last stage: target only; the first stage passes the inputs
    """

    def __init__(
        self,
        stage_module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        micro_batches: int,
        loss: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r}; allowed: an integer >= 1 (the accumulation cycle)")
        self.stage_index, self.num_stages, self.micro_batches = stage_index, num_stages, micro_batches
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.loss = loss
        self.micro_losses: List[torch.Tensor] = []
        stage = PipelineStage(stage_module, stage_index, num_stages, device, group=group)
        self.stage = stage
        self.schedule = schedule_class(schedule)(
            stage, n_microbatches=micro_batches, loss_fn=self._scaled_loss, scale_grads=False
        )

    @property
    def inferring(self) -> bool:
        """True while torch infers the shapes a stage sends (its first step runs the loss once more, on no
        micro-batch of the step: no micro-batch's forward is cached then)."""
        return not getattr(self.stage, "fwd_cache", True)

    def _scaled_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        loss = self.loss(outputs, target)
        if not self.inferring:
            self.micro_losses.append(loss.detach())
        return loss / self.micro_batches if self.micro_batches > 1 else loss

    def step(self, inputs: Sequence[Any], target: Optional[Any]) -> List[torch.Tensor]:
        """Forward and backward of one step's micro-batches (``inputs``: the first stage's, split along
        dim 0; ``target``: the last stage's); returns each micro-batch's loss on the last stage, [] elsewhere."""
        self.micro_losses = []
        arguments = tuple(inputs) if self.is_first else ()
        if self.is_last:
            self.schedule.step(*arguments, target=target, losses=[], return_outputs=False)
        else:
            self.schedule.step(*arguments, return_outputs=False)
        return self.micro_losses[-self.micro_batches :]  # the first step's shape inference may call the loss once more

    def evaluate(self, inputs: Sequence[Any], target: Optional[Any]) -> List[torch.Tensor]:
        """Forward only (the schedule's ``eval``) of the micro-batches; each one's loss on the last stage, [] elsewhere."""
        self.micro_losses = []
        arguments = tuple(inputs) if self.is_first else ()
        with torch.no_grad():
            if self.is_last:
                self.schedule.eval(*arguments, target=target, losses=[])
            else:
                self.schedule.eval(*arguments)
        return self.micro_losses[-self.micro_batches :]
