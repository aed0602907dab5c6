"""Recording metrics: values read back from the device at log points and epoch ends, written to
the history, the loggers (rank zero) and the ``on_log_metrics`` hooks."""

import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Set, Tuple

import torch

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.config.cli import resolved_config
from framework.loggers import LoggerSet, LoggerStartFailed, RunInfo, build_loggers
from framework.loop.hooks import HookDispatcher
from framework.loop.training_state import TrainingProgress
from framework.metrics.collector import MetricCollector, MetricHistory, reduce_metrics
from framework.metrics.loss_tracker import LossTracker, TrainingDiverged

logger = logging.getLogger("framework")


class MetricRecorder:
    """Where every recorded value goes, and when values are read back from the device.

    Args:
        args: ``stop_on_nonfinite_loss``, ``output_dir`` and ``epochs`` (the summary line).
        backend: reduces values over ranks.
        progress: the step and epoch each record carries.
        history: the run's metric history (queryable, checkpointed).
        loggers: the run's loggers (active on rank zero).
        hooks: ``on_log_metrics`` goes through it.
        collector: what ``module.log`` collected on the device.
        losses: the training loss, kept on the device.

    Example:
        recorder.log_train_metrics(stopping.flags())   # at a log point: one all-reduce
        recorder.record({"lr": 0.1})                     # host-side values, now
    """

    def __init__(
        self,
        *,
        args: TrainerArguments,
        backend: TrainerBackend,
        progress: TrainingProgress,
        history: MetricHistory,
        loggers: LoggerSet,
        hooks: HookDispatcher,
        collector: MetricCollector,
        losses: LossTracker,
    ) -> None:
        self.args, self.backend, self.progress, self.history = args, backend, progress, history
        self.loggers, self.hooks, self.collector, self.losses = loggers, hooks, collector, losses
        self.loggers_dir = args.output_dir  # where the loggers write: rebuilt when the run moves to version_<N>
        self.hidden_names: Callable[[], Set[str]] = set  # names logged with logger=False (the trainer sets the module's)
        self.sanity_checking = False
        """True during the sanity validation before training (``trainer.sanity_checking``): nothing is recorded."""

    def log_train_metrics(self, stop_flags: List[bool]) -> List[bool]:
        """Read the loss since the last log point (and logged step values) back from the device,
        with the ranks' ``stop_flags`` riding on the same all-reduce; record them. Returns the
        flags of any rank."""
        has_loss = self.losses.has_unlogged
        interval_mean = self.losses.interval_mean().float()
        if self.backend.world_size == 1:  # one read, nothing to agree on
            loss, any_flags = float(interval_mean), list(stop_flags)
        else:
            flags = torch.tensor([float(flag) for flag in stop_flags], device=self.backend.device)
            loss, *reduced = self.backend.all_reduce(torch.cat([interval_mean.reshape(1), flags])).tolist()
            any_flags = [flag > 0 for flag in reduced]
        self.losses.after_read(loss)
        self.losses.mark_logged()
        if has_loss:
            self.record_train_loss("train_loss", loss)
        self.record(self.reduce(self.collector.pop_step()))
        return any_flags

    def end_train_epoch(self, outputs_hook: Callable[[], None]) -> None:
        """The epoch's mean training loss, then ``outputs_hook`` (``on_end_train_epoch``), then what
        ``module.log`` collected for the epoch (from the steps and that hook)."""
        mean_loss = self.losses.epoch_mean()
        if mean_loss is not None:
            value = float(self.backend.all_reduce(mean_loss))
            self.losses.after_read(value)
            self.record_train_loss("train_loss_epoch", value)
        outputs_hook()
        epoch_values = self.collector.pop_epoch(self.backend.all_gather_object)  # ranks agree on Metric objects first
        self.record(self.reduce(epoch_values, agree_on_names=True))

    def record_train_loss(self, name: str, value: float) -> None:
        """Record a training loss read back from the device; a NaN/inf one ends the run (unless a
        GradScaler skips such steps: then it never reached the weights)."""
        if not math.isfinite(value) and self.args.stop_on_nonfinite_loss and not self.backend.skips_nonfinite_steps:
            first = self.losses.first_nonfinite_step()
            first = self.backend.min_over_ranks(first if first is not None else 2**62)
            raise TrainingDiverged(first, value)
        if name not in self.collector.claimed:  # a user's self.log of this name replaces it: one series per name
            self.record({name: value})

    def reduce(self, collected: Mapping[str, Tuple[Any, ...]], agree_on_names: bool = False) -> Dict[str, float]:
        """Collected device values as floats, reduced over ranks."""
        gather = self.backend.all_gather_object if agree_on_names else None  # once per epoch: a rank may have logged nothing
        reduced = reduce_metrics(collected, self.backend.data_parallel_all_reduce, self.backend.device, gather)
        strategy: Any = self.backend.strategy
        if getattr(strategy, "pipelined", False):  # pipeline_loss logs on the last stage: every stage records its values
            reduced = strategy.from_last_stage(reduced)
        return reduced

    def record(self, metrics: Dict[str, float]) -> None:
        """Add ``metrics`` to the history, the loggers (rank zero) and the ``on_log_metrics`` hooks
        (nothing while :attr:`sanity_checking`: Lightning keeps nothing its sanity check logs)."""
        if not metrics or self.sanity_checking:
            return
        step, epoch = self.progress.global_steps_finished, self.progress.epochs_finished
        records = [self.history.add(name, value, step, epoch) for name, value in metrics.items()]
        hidden = self.hidden_names()
        self.loggers.log([record for record in records if record["name"] not in hidden] if hidden else records)  # rank zero
        self.hooks.call("on_log_metrics", step, dict(metrics))

    def start_loggers(self, keep_existing: bool = False) -> None:
        """Start the loggers (rank zero) with the history so far; a later validate()/test() starts them again.

        Args:
            keep_existing: the run directory holds the run this one continues and has not resumed yet (an
                evaluation before training): the loggers keep its files and append.

        Raises:
            LoggerStartFailed: a logger could not start (on every rank).
        """
        args = self.args
        if args.output_dir != self.loggers_dir:  # the run moved to version_<N> (training, or an evaluation before it)
            self.loggers, self.loggers_dir = LoggerSet(build_loggers(args), active=self.loggers.active), args.output_dir

        def start() -> None:
            records = list(self.history.records)
            self.loggers.start(lambda: RunInfo(args.output_dir, resolved_config(args).to_dict(), records, keep_existing))

        # A logger that cannot start stops the run before step 1, on every rank (rank zero logs).
        self.backend.run_on_rank_zero(start, "could not start a logger", share_as=(LoggerStartFailed,))

    def log_epoch_summary(self) -> None:
        """One line per epoch: the values recorded in it (the step losses left out)."""
        epoch = self.progress.epochs_finished
        latest = {r["name"]: r["value"] for r in self.history.records if r["epoch"] == epoch and r["name"] != "train_loss"}
        summary = "  ".join(f"{name}={value:.4g}" for name, value in latest.items())
        logger.info("epoch %d/%d (step %d): %s", epoch + 1, self.args.epochs, self.progress.global_steps_finished, summary)
