"""Metric writers: where recorded values go on rank zero (CSV, TensorBoard)."""

import csv
import os
from typing import Any, Dict, Iterable, List, Optional, TextIO


class MetricWriter:
    """Receives every metric record on rank zero.

    Example:
        >>> class PrintWriter(MetricWriter):
        ...     def write(self, records):
        ...         for record in records:
        ...             print(record["name"], record["value"])
    """

    def start(self, records: List[Dict[str, Any]]) -> None:
        """Called once before training with the history so far (non-empty after a resume)."""

    def write(self, records: Iterable[Dict[str, Any]]) -> None:
        """Write newly recorded values."""

    def close(self) -> None:
        """Flush and release files."""


class CSVWriter(MetricWriter):
    """``metrics.csv`` with columns ``epoch, step, name, value``, one value per row.

    On start the file is rewritten from the history, so after a resume it holds exactly the
    values of the resumed run (nothing from steps that were lost). The trainer first makes sure
    the file is its own run's (:func:`framework.run_directory.check_output_dir_free`): a new
    run refuses an ``output_dir`` holding another run's ``metrics.csv``, so this never
    truncates another run's values.

    Example:
        >>> import tempfile
        >>> writer = CSVWriter(os.path.join(tempfile.mkdtemp(), "metrics.csv"))
        >>> writer.start([])
        >>> writer.write([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        >>> writer.close()
    """

    FIELDS = ("epoch", "step", "name", "value")

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: Optional[TextIO] = None
        self._writer: Optional[csv.DictWriter[str]] = None

    def start(self, records: List[Dict[str, Any]]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._handle = handle = open(self.path, "w", newline="")  # noqa: SIM115 - open across write() calls; closed in close()
        self._writer = writer = csv.DictWriter(handle, fieldnames=self.FIELDS)
        writer.writeheader()
        self.write(records)

    def write(self, records: Iterable[Dict[str, Any]]) -> None:
        if self._writer is None or self._handle is None:
            return
        self._writer.writerows(records)
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = self._writer = None


class TensorBoardWriter(MetricWriter):
    """Scalars to TensorBoard event files in ``log_dir`` (needs the ``[tensorboard]`` extra).

    Each record becomes ``add_scalar(name, value, step)``; ``val_loss/<loader>`` names group
    into one TensorBoard section. On a resume, events newer than the resumed step (written
    by the run that was lost) are purged, so each curve has one value per step.

    Example:
        writer = TensorBoardWriter("outputs/tensorboard")
        writer.start([])
        writer.write([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        writer.close()
    """

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "TensorBoard logging (tensorboard=True) needs the extra: pip install 'torch-trainer-framework[tensorboard]'"
            ) from error
        self.log_dir = log_dir
        self._summary_class = SummaryWriter
        self._summary: Any = None  # a SummaryWriter once started

    def start(self, records: List[Dict[str, Any]]) -> None:
        resumed_step = max((int(record["step"]) for record in records), default=None)
        purge_step = resumed_step + 1 if resumed_step is not None else None
        self._summary = self._summary_class(log_dir=self.log_dir, purge_step=purge_step)

    def write(self, records: Iterable[Dict[str, Any]]) -> None:
        if self._summary is None:
            return
        for record in records:
            self._summary.add_scalar(record["name"], record["value"], record["step"])

    def close(self) -> None:
        if self._summary is not None:
            self._summary.close()
        self._summary = None
