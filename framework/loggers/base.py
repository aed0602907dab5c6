"""The logger interface: where recorded metric values go on rank zero."""

from dataclasses import dataclass, field
from typing import Any, Dict, List

Record = Dict[str, Any]
"""One recorded value: ``{"epoch": int, "step": int, "name": str, "value": float}``."""

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
"""How a run ended, as :meth:`Logger.finish` is told (the statuses MLflow uses)."""


@dataclass
class RunInfo:
    """What a logger learns when the trainer starts it.

    Attributes:
        output_dir: the run's ``output_dir`` (``metrics.csv``, ``config.yaml``).
        config: the run's resolved configuration, section by section (what ``config.yaml`` holds).
        records: every value recorded so far, oldest first (non-empty after a resume).
        keep_existing: the run directory holds the run this one continues, not resumed yet (an evaluation
            before training): keep the values already written there and append (a file logger must not
            rewrite them from ``records``).
    """

    output_dir: str
    config: Dict[str, Any] = field(default_factory=dict)
    records: List[Record] = field(default_factory=list)
    keep_existing: bool = False


class Logger:
    """Receives the run's recorded metric values on rank zero, at log points only.

    The trainer calls :meth:`start` when ``train()``, ``validate()`` or ``test()`` begins,
    :meth:`log_metrics` with each batch of values it has already read back from the device,
    and :meth:`finish` when the call ends. Its :meth:`state_dict` is saved in every checkpoint
    and handed back to :meth:`load_state_dict` on resume, before :meth:`start` (a tracker's run
    id lives there, so a resumed run logs into the same tracker run). A logger that raises is
    named in one warning and not called again in that run; training goes on.

    Register a logger by name with :func:`framework.loggers.register_logger` or the
    entry-point group ``framework.loggers`` (a factory taking the ``TrainerArguments``), or
    pass an instance in ``TrainerArguments.loggers``.

    Example:
        >>> class PrintLogger(Logger):
        ...     name = "print"
        ...     def log_metrics(self, records):
        ...         for record in records:
        ...             print(record["step"], record["name"], record["value"])
        >>> PrintLogger().log_metrics([{"epoch": 0, "step": 1, "name": "train_loss", "value": 0.5}])
        1 train_loss 0.5
    """

    name: str = ""
    """How warnings name this logger (the registered name)."""

    def start(self, run: RunInfo) -> None:
        """Called when a train/validate/test call begins, with the values recorded so far."""

    def log_metrics(self, records: List[Record]) -> None:
        """Newly recorded values (already on the host)."""

    def finish(self, status: str) -> None:
        """The call ended: ``FINISHED``, ``FAILED`` or ``KILLED`` (preempted); flush and release."""

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of this logger (e.g. the tracker's run id)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (called before :meth:`start` on resume)."""
