"""The callbacks every run gets unless turned off or given by the user."""

from typing import TYPE_CHECKING, List, Sequence

from framework.callbacks.base import Callback
from framework.callbacks.metrics_plot import MetricsPlot, plots_by_default
from framework.callbacks.model_summary import ModelSummary
from framework.callbacks.progress import ProgressBar

if TYPE_CHECKING:  # pragma: no cover
    from framework.config.arguments import TrainerArguments


def with_default_callbacks(callbacks: Sequence[Callback], args: "TrainerArguments") -> List[Callback]:
    """``callbacks`` with the defaults put first: a :class:`ModelSummary` (unless
    ``args.model_summary`` is False) and a :class:`ProgressBar` (unless ``args.disable_tqdm``),
    each only when ``callbacks`` holds none of its kind; with ``args.profiler`` ``"throughput"`` or
    ``"torch"`` a :class:`Throughput`, and with ``"torch"`` a :class:`TorchProfiler`, likewise; a
    :class:`MetricsPlot` last where ``args.plot_metrics`` (None: matplotlib installed) says so.

    Example:
        >>> from framework import TrainerArguments
        >>> [type(c).__name__ for c in with_default_callbacks([], TrainerArguments(plot_metrics=False))]
        ['ModelSummary', 'ProgressBar']
        >>> [type(c).__name__ for c in with_default_callbacks([], TrainerArguments(plot_metrics=True, disable_tqdm=True))]
        ['ModelSummary', 'MetricsPlot']
        >>> [type(c).__name__ for c in with_default_callbacks([], TrainerArguments(model_summary=False, disable_tqdm=True))]
        []
        >>> [type(c).__name__ for c in with_default_callbacks([], TrainerArguments(profiler="torch", disable_tqdm=True))]
        ['ModelSummary', 'Throughput', 'TorchProfiler']
    """
    given = list(callbacks)
    defaults: List[Callback] = []
    if args.model_summary and not any(isinstance(callback, ModelSummary) for callback in given):
        defaults.append(ModelSummary())
    if not args.disable_tqdm and not any(isinstance(callback, ProgressBar) for callback in given):
        defaults.append(ProgressBar())
    if args.profiler != "off":  # imported here: a run without the profiler never loads them
        from framework.callbacks.profiler import TorchProfiler
        from framework.callbacks.throughput import Throughput

        if not any(isinstance(callback, Throughput) for callback in given):
            defaults.append(Throughput())
        if args.profiler == "torch" and not any(isinstance(callback, TorchProfiler) for callback in given):
            defaults.append(TorchProfiler())
    if plots_by_default(args.plot_metrics) and not any(isinstance(callback, MetricsPlot) for callback in given):
        defaults.append(MetricsPlot())
    return defaults + given
