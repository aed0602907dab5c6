"""Files a tracker keeps with its run: the config and the metrics plot."""

import logging
import os
from typing import List

logger = logging.getLogger("framework")


def artifact_paths(output_dir: str) -> List[str]:
    """``config.yaml`` and ``metrics.png``, drawn from ``metrics.csv`` when matplotlib is installed."""
    paths = [os.path.join(output_dir, "config.yaml")]
    csv_path = os.path.join(output_dir, "metrics.csv")
    if os.path.exists(csv_path):
        try:
            from framework.metrics.background_plot import wait_for_plots
            from framework.metrics.plot import plot_metrics

            drawn = wait_for_plots(os.path.join(output_dir, "metrics.png"))  # MetricsPlot's, in the background
            paths.append(drawn[0] if drawn else plot_metrics(csv_path))
        except (ImportError, ValueError) as error:  # no matplotlib, or nothing to draw
            logger.debug("no metrics plot for the tracker: %s", error)
    return [path for path in paths if os.path.exists(path)]
