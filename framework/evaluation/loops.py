"""Evaluation: every validation or test loader once, without gradients, outputs in dataset order."""

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.evaluation.pipeline_eval import pipeline_evaluation
from framework.loop.hooks import HookDispatcher
from framework.loop.module_checks import report_no_loaders
from framework.loop.stage import Stage
from framework.loop.step_outputs import as_outputs, concatenate_outputs
from framework.metrics.collector import MetricCollector, infer_batch_size, reduce_metrics
from framework.module import ModuleInterface, as_loader_dict


class Evaluator:
    """Runs the module's validation or test loaders and records what they measured.

    For each loader: ``on_begin_<stage>_epoch``, the step method on every batch under
    ``torch.no_grad()``, the outputs of every rank gathered in dataset order, then
    ``on_end_<stage>_epoch`` with them; the mean of the first output over every sample becomes
    ``<stage>_loss`` (``/<name>`` for named loaders), next to what the steps and the hook logged.
    A per-sample loss counts each element; a scalar loss is weighted by its batch's size, so
    the value is exact whatever the batch sizes and the world size. A step that returns None
    (Lightning's usual validation step, which only calls ``self.log``) adds no loss and no outputs:
    what it logged is what is recorded. A rank that got no batch (fewer samples than ranks) still
    joins every collective.

    Args:
        module: the user's module.
        runner: the step dispatcher (unwrapped: evaluation needs no gradient sync).
        backend: the trainer's backend.
        hooks: the trainer's hook dispatcher.
        args: the run's arguments (batch size, batch limits, seed).
        record: called with each loader's metrics (history, loggers, ``on_log_metrics``).

    Example:
        evaluator = Evaluator(module=module, runner=runner, backend=backend, hooks=hooks, args=args, record=print)
        metrics = evaluator.run(Stage.VAL, global_step=100)
    """

    def __init__(
        self,
        *,
        module: ModuleInterface,
        runner: torch.nn.Module,
        backend: TrainerBackend,
        hooks: HookDispatcher,
        args: TrainerArguments,
        record: Callable[[Dict[str, float]], None],
    ) -> None:
        self.module = module
        self.runner = runner
        self.backend = backend
        self.hooks = hooks
        self.args = args
        self.record = record
        self.current_batches: Optional[int] = None
        """Batches the loader being evaluated runs on this rank (None: unknown); set before
        ``on_begin_<stage>_epoch`` (progress bars read it)."""

    def loaders(self, stage: Stage, batch_size: int) -> Dict[str, Any]:
        """The module's loaders for ``stage`` as ``{name: loader}`` (``""`` for a single one)."""
        sampler = self.backend.sampler_factory(shuffle=False, seed=self.args.seed)
        get_loaders = self.module.get_val_dataloaders if stage is Stage.VAL else self.module.get_test_dataloaders
        loaders = as_loader_dict(get_loaders(sampler, batch_size), get_loaders.__name__)
        if not loaders and stage is Stage.TEST:
            report_no_loaders(get_loaders.__name__)
        return {name: self.backend.prepare_loader(loader) for name, loader in loaders.items()}

    def run(
        self, stage: Stage, global_step: int, batch_size: int, max_batches: Optional[int] = None, record: bool = True
    ) -> Dict[str, float]:
        """Evaluate every loader of ``stage``; with ``record=False`` (sanity checks) run the steps and
        the hooks, as a recorded evaluation does, but record nothing they measured or logged."""
        results: Dict[str, float] = {}
        loaders = self.loaders(stage, batch_size)
        if not loaders:  # nothing to evaluate: the model stays as it is (train/eval walks every submodule)
            return results
        was_training = self.module.training
        previous_logger, collector, losses = self.module._metric_logger, MetricCollector(), MetricCollector()
        self.module._metric_logger = collector
        self.module.eval()
        try:
            for key, loader in loaders.items():
                limits = (max_batches, _batch_limit(self.args.max_val_steps_per_epoch, loader))  # sanity: the smaller
                limit = min((n for n in limits if n is not None), default=None)
                self.current_batches = _planned_batches(loader, limit)
                self.hooks.call(f"on_begin_{stage.value}_epoch", global_step, key=key)
                collected = self._run_steps(stage, global_step, loader, limit, losses, f"on_end_{stage.value}_step", key)
                outputs = self.backend.gather_in_dataset_order(concatenate_outputs(collected))
                suffix = f"/{key}" if key else ""
                self.hooks.call(f"on_end_{stage.value}_epoch", global_step, *outputs, key=key)
                if not record:  # a sanity check: the hooks ran, what they and the steps logged is dropped
                    collector.reset_metric_objects()  # a sanity check's updates never count (no compute())
                    for dropped in (losses, collector):
                        dropped.pop_epoch()
                    continue
                loss_name = f"{stage.value}_loss"
                logged = collector.pop_epoch(self.backend.all_gather_object)  # ranks agree on Metric objects first
                to_reduce = {**{f"/{name}": value for name, value in logged.items()}, **losses.pop_epoch()}
                reduced = reduce_metrics(
                    to_reduce, self.backend.data_parallel_all_reduce, self.backend.device, self.backend.all_gather_object
                )
                metrics = {f"{loss_name}{suffix}": reduced[loss_name]} if loss_name in reduced else {}
                metrics.update({f"{name[1:]}{suffix}": value for name, value in reduced.items() if name.startswith("/")})
                self.record(metrics)
                results.update(metrics)
        finally:
            self.module.train(was_training)
            self.module._metric_logger = previous_logger
        return results

    def _run_steps(
        self,
        stage: Stage,
        global_step: int,
        loader: Iterable,
        limit: Optional[int],
        losses: MetricCollector,
        step_hook: Optional[str] = None,
        key: str = "",
    ) -> List[Tuple[Any, ...]]:
        """Every step's outputs; each step's loss goes into ``losses`` weighted by its samples;
        ``step_hook`` (``on_end_val_step``...) is called after each step."""
        collected = []
        method, device, loss_name = f"{stage.value}_step", self.backend.device, f"{stage.value}_loss"
        pipeline = pipeline_evaluation(self.module, self.backend)  # a pipeline: through the schedule's eval
        with torch.no_grad(), self.backend.inference(self.runner):  # fsdp: the shards are gathered, then freed
            for index, batch in enumerate(loader):
                if limit is not None and index >= limit:
                    break
                batch = self.backend.move_to_device(batch)
                if pipeline is not None:
                    returned = pipeline(stage, global_step, batch, device)
                else:
                    returned = self.backend.forward(self.runner, stage, global_step, batch, device)
                if returned is None:  # Lightning's usual step: it only calls self.log; no <stage>_loss then
                    if step_hook is not None:
                        self.hooks.call(step_hook, global_step, key=key)
                    continue
                outputs = as_outputs(returned, method)
                loss = outputs[0]
                if loss.numel():
                    losses.log(loss_name, loss, batch_size=loss.numel() if loss.dim() else infer_batch_size(batch))
                collected.append(outputs)
                if step_hook is not None:
                    self.hooks.call(step_hook, global_step, *outputs, key=key)
        return collected


def _planned_batches(loader: Iterable, limit: Optional[int]) -> Optional[int]:
    """How many batches of ``loader`` an evaluation runs: its length, capped by ``limit`` (None: unknown)."""
    try:
        length = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return limit
    return length if limit is None else min(length, limit)


def _batch_limit(limit: Optional[float], loader: Iterable) -> Optional[int]:
    if limit is None or isinstance(limit, int):
        return limit
    return max(1, math.floor(limit * len(loader)))  # type: ignore[arg-type]
