"""Mutants of a pipeline plugin (``fsdp`` with ``pipeline_parallel_size=2``: the ``fsdp-pp`` row, see
:mod:`framework.conformance.pipeline_rows`), one slip in one overridden method each, killed by the
``pipeline`` shape's cells at 2 ranks (pp 2); each passes the other cells of the row."""

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from backends import FSDP, FullPrecision
from backends.checkpoint_io import CheckpointIO
from backends.data.samplers import ResumableSampler
from backends.strategies.gradient_clipping import clip_gradients
from backends.strategies.pipeline_schedule import PipelineRunner
from framework.conformance.mutants.library import register_mutant
from framework.conformance.pipeline_rows import PipelineRow

CONTROL = "fsdp-pp"


class StageNormClip(FSDP):
    """Clips each stage by its own gradients' norm: the norm is never summed over the pipeline's stages."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        return clip_gradients(parameters, max_norm, max_value)  # fault: no pipeline_group


class LossFromFirstStage(FSDP):
    """Broadcasts the step's losses from the first stage (which has none: zeros), not the last: every rank logs stage 0's."""

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, group=self.pipeline_group(), group_src=0)  # fault: the first stage, not the last
        return tensor


class PeersReadDifferentBatches(FSDP):
    """Splits the data over every rank, the pipeline's included: pp peers read different batches."""

    def create_sampler(self, dataset: Any, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        pad = shuffle if pad is None else pad
        # fault: the global rank and size, not the data-parallel ones (which exclude pp)
        return ResumableSampler(dataset, shuffle=shuffle, seed=seed, rank=self.rank, world_size=self.world_size, pad=pad)


def by_position(saved: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's state keyed by name as ``optimizer.state_dict()`` keys it: by each parameter's position."""
    names = [name for group in saved["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(names)}
    groups = [{**group, "params": [position[name] for name in group["params"]]} for group in saved["param_groups"]]
    return {"state": {position[name]: value for name, value in saved["state"].items()}, "param_groups": groups}


class IndexKeyedOptimizer(FSDP):
    """Writes optimizer state keyed by parameter index (``optimizer.state_dict()``'s keys): every stage has its own index 0."""

    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        trainer = state.get("trainer")
        if isinstance(trainer, dict) and trainer.get("optimizers"):  # fault: positions, not names
            state = {**state, "trainer": {**trainer, "optimizers": [by_position(saved) for saved in trainer["optimizers"]]}}
        return super().save_checkpoint(path, state, io, copy)


class LastUnscaledRunner(PipelineRunner):
    """Divides every micro-batch's loss by the count but the last one's."""

    def _scaled_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        loss = self.loss(outputs, target)
        if not self.inferring:
            self.micro_losses.append(loss.detach())
        if len(self.micro_losses) == self.micro_batches:  # fault: the last micro-batch's loss is not scaled
            return loss
        return loss / self.micro_batches if self.micro_batches > 1 else loss


class LastMicroBatchUnscaled(FSDP):
    """Its pipeline runner leaves the last micro-batch's loss unscaled (the others divided by the micro-batch count)."""

    def pipeline_runner(
        self, micro_batches: int, loss: Callable[[Any, Any], torch.Tensor], inputs: Sequence[Any] = ()
    ) -> PipelineRunner:
        runner = super().pipeline_runner(micro_batches, loss, inputs)
        if type(runner) is not LastUnscaledRunner:  # the plugin's own runner class, built like the built-in one
            schedule = self.pipeline_schedule if micro_batches >= self.pipeline_parallel_size else "GPipe"
            group = self.pipeline_group()
            stage, stages = self.pipeline_rank, self.pipeline_parallel_size
            stage_module = self.stage_module
            assert stage_module is not None, "the stage is cut before its first step"
            runner = LastUnscaledRunner(stage_module, stage, stages, self.device, group, schedule, micro_batches, loss)
            key = (micro_batches, tuple(tuple(getattr(tensor, "shape", ())) for tensor in inputs))
            self._runners[key] = runner
        return runner


def _register(name: str, strategy: Any, kills: Any, kind: str) -> None:
    fault = (strategy.__doc__ or "").strip().splitlines()[0]
    factory: Callable[[Any], Any] = lambda args: PipelineRow(strategy.from_arguments(args), FullPrecision())  # noqa: E731
    register_mutant(name, factory, fault, kills, kind, control=CONTROL)


MUTANTS: List[str] = []
for _name, _strategy, _kills, _kind in (
    ("mutant-fsdp-pp-stage-norm-clip", StageNormClip, (("clipping", "pipeline", 2),), "clipping"),
    ("mutant-fsdp-pp-loss-from-first-stage", LossFromFirstStage, (("automatic", "pipeline", 2),), "collectives"),
    ("mutant-fsdp-pp-index-keyed-optimizer", IndexKeyedOptimizer, (("resume_kill9", "pipeline", 2),), "state"),
    ("mutant-fsdp-pp-peers-read-different-batches", PeersReadDifferentBatches, (("automatic", "pipeline", 2),), "data"),
    ("mutant-fsdp-pp-last-micro-batch-unscaled", LastMicroBatchUnscaled, (("accumulation", "pipeline", 2),), "precision"),
):
    _register(_name, _strategy, _kills, _kind)
    MUTANTS.append(_name)
