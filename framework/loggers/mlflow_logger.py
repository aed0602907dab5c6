"""MLflow: params, metrics at their global step, artifacts, and one tracker run across resumes."""

import logging
import os
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from framework.loggers.artifacts import artifact_paths
from framework.loggers.base import Logger, Record, RunInfo

logger = logging.getLogger("framework")
OUTPUT_DIR_TAG = "framework.output_dir"
"""The MLflow run tag holding the run's absolute ``output_dir``."""

_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics and 100 params per call
_PARAM_BATCH = 100


def flatten_config(config: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested mappings as dotted keys, e.g. ``{"trainer": {"epochs": 3}}`` -> ``{"trainer.epochs": 3}``.

    Example:
        >>> flatten_config({"trainer": {"epochs": 3, "checkpointer_args": {"keep_last_n": 2}}})
        {'trainer.epochs': 3, 'trainer.checkpointer_args.keep_last_n': 2}
    """
    flat: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class MLflowLogger(Logger):
    """Logs the run to MLflow (needs the ``[mlflow]`` extra).

    The tracking server is MLflow's own choice: ``MLFLOW_TRACKING_URI`` where set, else
    MLflow's default (a local ``sqlite:///mlflow.db`` in recent versions); the experiment is
    ``MLFLOW_EXPERIMENT_NAME`` (created if missing) or ``MLFLOW_EXPERIMENT_ID``, else MLflow's
    default experiment. The run's config goes in as params (dotted keys such as
    ``trainer.epochs``), every metric at its global step, and when a call ends ``config.yaml``
    and the metrics plot (``metrics.png``, with matplotlib) as artifacts. The run ends
    ``FINISHED``, ``FAILED`` or ``KILLED`` (preempted).

    The MLflow run id is part of the checkpoint (:meth:`state_dict`), so a resumed or requeued
    run logs into the same MLflow run. Each run is tagged with its ``output_dir``
    (:data:`OUTPUT_DIR_TAG`): a run whose process died before its first checkpoint is ended
    ``KILLED`` when the next run starts there. On start, the points MLflow already holds are matched
    against the restored history, so a step logged before a kill is never logged twice, and
    a value a failed tracker missed is sent late.

    Args:
        run_name: the MLflow run's name (default: the ``output_dir``'s base name).
        tracking_uri: overrides ``MLFLOW_TRACKING_URI``.

    Example:
        args = TrainerArguments(loggers=["csv", "mlflow"])   # or --trainer.loggers '[csv,mlflow]'
    """

    name = "mlflow"

    def __init__(self, run_name: Optional[str] = None, tracking_uri: Optional[str] = None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise ImportError("the mlflow logger needs the extra: pip install 'torch-trainer-framework[mlflow]'") from error
        self._client_class = MlflowClient
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.run_id: Optional[str] = None
        self._client: Any = None
        self._already_logged: Counter[Tuple[str, int]] = Counter()  # points the tracker holds that the history repeats
        self._output_dir = ""

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    # -- lifecycle --------------------------------------------------------------------
    def start(self, run: RunInfo) -> None:
        client = self._client = self._client_class(tracking_uri=self.tracking_uri)
        self._output_dir = run.output_dir
        if self.run_id is None:
            output_dir = os.path.abspath(run.output_dir)
            name = self.run_name or os.path.basename(os.path.normpath(output_dir))
            experiment = self._experiment_id(client)
            self._end_orphans(client, experiment, output_dir)
            self.run_id = client.create_run(experiment, run_name=name, tags={OUTPUT_DIR_TAG: output_dir}).info.run_id
            logger.info("mlflow: logging to run %s at %s", self.run_id, client.tracking_uri)
        else:
            client.update_run(self.run_id, status="RUNNING")
            logger.info("mlflow: resumed run %s at %s", self.run_id, client.tracking_uri)
        existing = client.get_run(self.run_id).data
        self._already_logged = Counter(
            (key, int(point.step)) for key in existing.metrics for point in client.get_metric_history(self.run_id, key)
        )
        self._log_params(client, flatten_config(run.config), existing.params)
        self.log_metrics(run.records)

    def log_metrics(self, records: List[Record]) -> None:
        if self._client is None or self.run_id is None or not records:
            return
        from mlflow.entities import Metric

        metrics = []
        for record in records:
            point = (str(record["name"]), int(record["step"]))
            if self._already_logged[point] > 0:  # logged before a kill, or before a resume
                self._already_logged[point] -= 1
                continue
            metrics.append(Metric(point[0], float(record["value"]), _now_ms(), point[1]))
        for index in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[index : index + _BATCH])

    def finish(self, status: str) -> None:
        client, run_id = self._client, self.run_id
        if client is None or run_id is None:
            return
        self._client = None
        try:
            for path in artifact_paths(self._output_dir):
                client.log_artifact(run_id, path)
        finally:
            client.set_terminated(run_id, status=status)

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _experiment_id(client: Any) -> str:
        experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if experiment_id:
            return experiment_id
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default")
        experiment = client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else client.create_experiment(name)

    @staticmethod
    def _end_orphans(client: Any, experiment: str, output_dir: str) -> None:
        """End as ``KILLED`` the runs this output_dir left ``RUNNING``: a process killed before its
        first checkpoint (which would have carried the MLflow run id) never ended its run. Only
        one live run uses an output_dir (the run lock), so such a run is dead."""
        for orphan in client.search_runs([experiment], filter_string="attributes.status = 'RUNNING'", max_results=1000):
            if orphan.data.tags.get(OUTPUT_DIR_TAG) == output_dir:
                client.set_terminated(orphan.info.run_id, status="KILLED")
                logger.info("mlflow: ended run %s as KILLED (its process died before its first checkpoint)", orphan.info.run_id)

    def _log_params(self, client: Any, flat: Dict[str, Any], existing: Dict[str, str]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:6000]) for key, value in flat.items() if key not in existing]
        for index in range(0, len(params), _PARAM_BATCH):
            client.log_batch(self.run_id, params=params[index : index + _PARAM_BATCH])


def _now_ms() -> int:
    return int(time.time() * 1000)
