"""TensorBoard event files."""

from typing import Any, List

from framework.loggers.base import Logger, Record, RunInfo


class TensorBoardLogger(Logger):
    """Scalars to TensorBoard event files in ``log_dir`` (needs the ``[tensorboard]`` extra).

    Each record becomes ``add_scalar(name, value, step)``; ``val_loss/<loader>`` names group
    into one TensorBoard section. On a resume, events newer than the resumed step (written
    by the run that was lost) are purged, so each curve has one value per step.

    Example:
        tensorboard = TensorBoardLogger("outputs/tensorboard")
        tensorboard.start(RunInfo(output_dir="outputs"))
        tensorboard.log_metrics([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.3}])
        tensorboard.finish("FINISHED")
    """

    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "the tensorboard logger needs the extra: pip install 'torch-trainer-framework[tensorboard]'"
            ) from error
        self.log_dir = log_dir
        self._summary_class = SummaryWriter
        self._summary: Any = None  # a SummaryWriter once started

    def start(self, run: RunInfo) -> None:
        resumed_step = max((int(record["step"]) for record in run.records), default=None)
        purge_step = resumed_step + 1 if resumed_step is not None else None
        self._summary = self._summary_class(log_dir=self.log_dir, purge_step=purge_step)

    def log_metrics(self, records: List[Record]) -> None:
        if self._summary is None:
            return
        for record in records:
            self._summary.add_scalar(record["name"], record["value"], record["step"])

    def finish(self, status: str) -> None:
        if self._summary is not None:
            self._summary.close()
        self._summary = None
