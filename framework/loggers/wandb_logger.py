"""Weights & Biases: config, metrics at their global step, one W&B run across resumes."""

import logging
import os
from itertools import groupby
from typing import Any, Dict, List, Optional

from framework.loggers.artifacts import artifact_paths
from framework.loggers.base import FINISHED, Logger, Record, RunInfo

logger = logging.getLogger("framework")


class WandbLogger(Logger):
    """Logs the run to Weights & Biases (needs the ``[wandb]`` extra).

    ``wandb.init`` reads its usual environment (``WANDB_PROJECT``, ``WANDB_ENTITY``,
    ``WANDB_MODE=offline`` to write only local files, ``WANDB_API_KEY``); the files go under
    ``<output_dir>/wandb``. The config is the run's config, every metric is logged at its
    global step, ``metrics.png`` is saved with the run when a call ends,
    and the run ends with exit code 0 (``FINISHED``) or 1 (``FAILED``, ``KILLED``).

    The W&B run id is part of the checkpoint (:meth:`state_dict`): a resumed or requeued run
    resumes the same W&B run (``resume="allow"``) without sending the restored history again.
    Online, W&B ignores steps below the run's last logged step; offline it cannot know them,
    so the steps between the checkpoint and a kill appear in both attempts' offline files.

    Args:
        project: the W&B project (default: ``WANDB_PROJECT``, else W&B's default).
        run_name: the run's display name (default: the ``output_dir``'s base name).

    Example:
        args = TrainerArguments(loggers=["csv", "wandb"])   # WANDB_MODE=offline for local files only
    """

    name = "wandb"

    def __init__(self, project: Optional[str] = None, run_name: Optional[str] = None) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("the wandb logger needs the extra: pip install 'torch-trainer-framework[wandb]'") from error
        self._wandb = wandb
        self.project = project
        self.run_name = run_name
        self.run_id: Optional[str] = None
        self._run: Any = None
        self._output_dir = ""
        self._first_step = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    def start(self, run: RunInfo) -> None:
        resumed = self.run_id is not None
        self._output_dir = run.output_dir
        os.makedirs(run.output_dir, exist_ok=True)
        self._run = self._wandb.init(
            project=self.project,
            name=self.run_name or os.path.basename(os.path.normpath(os.path.abspath(run.output_dir))),
            id=self.run_id,
            resume="allow" if resumed else None,
            dir=run.output_dir,
            config=run.config,
            reinit="create_new",
        )
        self.run_id = self._run.id
        self._first_step = int(getattr(self._run, "starting_step", 0) or 0)
        logger.info("wandb: %s run %s", "resumed" if resumed else "logging to", self.run_id)
        if not resumed:
            self.log_metrics(run.records)

    def log_metrics(self, records: List[Record]) -> None:
        if self._run is None:
            return
        for step, group in groupby(records, key=lambda record: int(record["step"])):
            if step >= self._first_step:
                self._run.log({record["name"]: float(record["value"]) for record in group}, step=step)

    def finish(self, status: str) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            for path in artifact_paths(self._output_dir):
                if os.path.basename(path) != "config.yaml":  # W&B keeps the config itself, as files/config.yaml
                    run.save(path, base_path=os.path.dirname(path), policy="now")
        finally:
            run.finish(exit_code=0 if status == FINISHED else 1)
