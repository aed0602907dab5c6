"""``metrics.csv``: every recorded value, one row each."""

import csv
import io
import os
from typing import IO, Any, List, Optional

from backends.checkpoint_io import run_files
from framework.loggers.base import Logger, Record, RunInfo


class CSVLogger(Logger):
    """``metrics.csv`` with columns ``epoch, step, name, value``, one value per row.

    On start the file is rewritten from the history, so after a resume it holds exactly the
    values of the resumed run (nothing from steps that were lost). The trainer first makes sure
    the file is its own run's (:func:`framework.run.run_directory.check_output_dir_free`): a new
    run refuses an ``output_dir`` holding another run's ``metrics.csv``, so this never
    truncates another run's values; an evaluation before training of the run it continues
    (``RunInfo.keep_existing``) appends to the file as it is.

    Example:
        >>> import os, tempfile
        >>> csv_logger = CSVLogger(os.path.join(tempfile.mkdtemp(), "metrics.csv"))
        >>> csv_logger.start(RunInfo(output_dir="unused"))
        >>> csv_logger.log_metrics([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        >>> csv_logger.finish("FINISHED")
    """

    name = "csv"
    FIELDS = ("epoch", "step", "name", "value")

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: Optional[IO[str]] = None
        self._writer: Optional[Any] = None  # a csv.DictWriter while started

    def start(self, run: RunInfo) -> None:
        if not (run.keep_existing and os.path.lexists(self.path)):  # the continued run's rows stay as written
            history = io.StringIO()
            writer = csv.DictWriter(history, fieldnames=self.FIELDS)
            writer.writeheader()
            writer.writerows(run.records)
            # A new file replaces whatever is there (a link is replaced, its target untouched), then rows are appended.
            run_files.write_bytes(self.path, history.getvalue().encode("utf-8"), run_files.METRICS)
        self._handle = handle = run_files.open_for_appending(self.path, run_files.METRICS)
        self._writer = csv.DictWriter(handle, fieldnames=self.FIELDS)

    def log_metrics(self, records: List[Record]) -> None:
        if self._writer is None or self._handle is None:
            return
        self._writer.writerows(records)
        self._handle.flush()

    def finish(self, status: str) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = self._writer = None
