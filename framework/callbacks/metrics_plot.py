"""MetricsPlot: ``metrics.png`` (every recorded metric against the step) when training ends."""

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Optional

from framework.callbacks.base import Callback
from framework.metrics.background_plot import BackgroundPlot, wait_for_plots

if TYPE_CHECKING:  # pragma: no cover
    from framework.loop.view import TrainerView

logger = logging.getLogger(__name__)

DISABLE_VARIABLE = "FRAMEWORK_PLOT_METRICS"
"""``FRAMEWORK_PLOT_METRICS=0`` turns the default plot off where ``plot_metrics`` is left at None
(test suites and CI set it: drawing costs a fraction of a second per run)."""


def plots_by_default(plot_metrics: Optional[bool]) -> bool:
    """Whether a run draws ``metrics.png``: ``plot_metrics`` when given, else when matplotlib is
    installed and ``FRAMEWORK_PLOT_METRICS`` is not ``0``.

    Example:
        >>> plots_by_default(False), plots_by_default(True)
        (False, True)
    """
    if plot_metrics is not None:
        return plot_metrics
    if os.environ.get(DISABLE_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("matplotlib") is not None


class MetricsPlot(Callback):
    """Draw ``<output_dir>/metrics.png`` from ``metrics.csv`` when training ends, on rank zero
    (:func:`framework.metrics.plot.plot_metrics`: a panel per quantity, losses on a log axis).

    Added by default where matplotlib is installed (``TrainerArguments.plot_metrics``). By default
    the plot is drawn in the background (:mod:`framework.metrics.background_plot`): a process of
    its own starts with training and imports matplotlib meanwhile, and ``train()`` returns as soon
    as it has handed over the metrics; the drawing is joined before the interpreter exits and
    before a next run's plot of the same directory starts (or call
    :func:`~framework.metrics.background_plot.wait_for_plots`, or :meth:`wait`). ``fast_dev_run``
    draws nothing. Without a ``metrics.csv`` (the ``csv`` logger left out) it draws nothing; a
    failure to draw is a warning, never a failed run.

    Args:
        background: False draws in ``on_end_train`` itself (``train()`` waits for it).

    Example:
        plot = MetricsPlot()                  # the default where TrainerArguments(plot_metrics=True)
        Trainer(module, args, callbacks=[plot]).train()
        plot.wait()                           # the PNG's path once drawn (None: not drawn; a warning says why)
    """

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self.path: Optional[str] = None
        """The PNG of the last run: drawn, or being drawn in the background (None: none yet)."""
        self._drawing: Optional[BackgroundPlot] = None  # started with training, not yet given metrics
        self._last: Optional[BackgroundPlot] = None  # the last drawing given metrics

    def setup(self, trainer: "TrainerView") -> None:
        super().setup(trainer)
        if trainer.is_main_process:  # an earlier run's drawing of this PNG lands first
            wait_for_plots(os.path.join(trainer.args.output_dir, "metrics.png"))

    def on_begin_train(self, global_step: int) -> None:
        trainer = self.trainer
        if self._drawing is not None:
            self._drawing.cancel()  # an earlier train() that ended without on_end_train
        self._drawing = None
        if not self.background or not trainer.is_main_process or trainer.args.fast_dev_run:
            return
        output_dir = trainer.args.output_dir
        if os.path.isfile(os.path.join(output_dir, "metrics.csv")):  # started: the csv logger is on
            self._drawing = BackgroundPlot(os.path.join(output_dir, "metrics.png"))

    def on_end_train(self, global_step: int) -> None:
        trainer = self.trainer
        drawing, self._drawing = self._drawing, None
        csv_path = os.path.join(trainer.args.output_dir, "metrics.csv")
        if not trainer.is_main_process or trainer.args.fast_dev_run or not os.path.isfile(csv_path):
            if drawing is not None:
                drawing.cancel()
            return
        if drawing is not None:
            self.path = drawing.output
            self._last = drawing
            drawing.draw(csv_path)
            return
        from framework.metrics.plot import plot_metrics

        try:
            self.path = plot_metrics(csv_path)
        except (ImportError, ValueError, OSError) as error:
            logger.warning("metrics.png not drawn (%s: %s); training itself finished", type(error).__name__, error)
            return
        logger.info("metrics plot: %s", self.path)

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Wait for the last run's background drawing; its PNG's path, or None where it failed
        (a warning was logged) or was not drawn.

        Example:
            plot = MetricsPlot(); Trainer(module, args, callbacks=[plot]).train(); plot.wait()
        """
        return self.path if self._last is None else self._last.wait(timeout)
