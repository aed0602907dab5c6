"""``metrics.csv``: every recorded value, one row each."""

import csv
import os
from typing import Any, List, Optional, TextIO

from framework.loggers.base import Logger, Record, RunInfo


class CSVLogger(Logger):
    """``metrics.csv`` with columns ``epoch, step, name, value``, one value per row.

    On start the file is rewritten from the history, so after a resume it holds exactly the
    values of the resumed run (nothing from steps that were lost). The trainer first makes sure
    the file is its own run's (:func:`framework.run.run_directory.check_output_dir_free`): a new
    run refuses an ``output_dir`` holding another run's ``metrics.csv``, so this never
    truncates another run's values.

    Example:
        >>> import tempfile
        >>> csv_logger = CSVLogger(os.path.join(tempfile.mkdtemp(), "metrics.csv"))
        >>> csv_logger.start(RunInfo(output_dir="unused"))
        >>> csv_logger.log_metrics([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        >>> csv_logger.finish("FINISHED")
    """

    name = "csv"
    FIELDS = ("epoch", "step", "name", "value")

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: Optional[TextIO] = None
        self._writer: Optional[Any] = None  # a csv.DictWriter while started

    def start(self, run: RunInfo) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._handle = handle = open(self.path, "w", newline="")  # noqa: SIM115 - open across calls; closed in finish()
        self._writer = writer = csv.DictWriter(handle, fieldnames=self.FIELDS)
        writer.writeheader()
        self.log_metrics(run.records)

    def log_metrics(self, records: List[Record]) -> None:
        if self._writer is None or self._handle is None:
            return
        self._writer.writerows(records)
        self._handle.flush()

    def finish(self, status: str) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = self._writer = None
