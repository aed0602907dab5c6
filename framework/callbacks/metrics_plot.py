"""MetricsPlot: ``metrics.png`` (every recorded metric against the step) when training ends."""

import importlib.util
import logging
import os
from typing import Optional

from framework.callbacks.base import Callback

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

    Added by default where matplotlib is installed (``TrainerArguments.plot_metrics``). Without a
    ``metrics.csv`` (the ``csv`` logger left out) it draws nothing; a failure to draw is a warning,
    never a failed run.

    Example:
        trainer = Trainer(module, args, callbacks=[MetricsPlot()])   # or TrainerArguments(plot_metrics=True)
    """

    def __init__(self) -> None:
        self.path: Optional[str] = None
        """The PNG written at the end of the last run (None: none yet)."""

    def on_end_train(self, global_step: int) -> None:
        trainer = self.trainer
        csv_path = os.path.join(trainer.args.output_dir, "metrics.csv")
        if not trainer.is_main_process or not os.path.isfile(csv_path):
            return
        from framework.metrics.plot import plot_metrics

        try:
            self.path = plot_metrics(csv_path)
        except (ImportError, ValueError, OSError) as error:
            logger.warning("metrics.png not drawn (%s: %s); training itself finished", type(error).__name__, error)
            return
        logger.info("metrics plot: %s", self.path)
