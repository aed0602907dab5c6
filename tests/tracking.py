"""Reading back what the mlflow and wandb loggers wrote: an MLflow store and W&B offline files."""

import csv
import glob
import json
import os
import struct
from collections import Counter
from typing import Any, Dict, Iterator, List, Tuple

Point = Tuple[str, int, float]


def csv_points(output_dir: str) -> "Counter[Point]":
    """Every (name, step, value) of ``metrics.csv``."""
    with open(os.path.join(output_dir, "metrics.csv")) as handle:
        return Counter((row["name"], int(row["step"]), float(row["value"])) for row in csv.DictReader(handle))


def mlflow_runs(tracking_uri: str) -> List[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    return client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])


def mlflow_points(tracking_uri: str, run_id: str) -> "Counter[Point]":
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    return Counter(
        (key, int(point.step), float(point.value))
        for key in client.get_run(run_id).data.metrics
        for point in client.get_metric_history(run_id, key)
    )


def mlflow_artifacts(tracking_uri: str, run_id: str) -> List[str]:
    from mlflow.tracking import MlflowClient

    return sorted(info.path for info in MlflowClient(tracking_uri).list_artifacts(run_id))


_BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf records in 32 KiB blocks


def wandb_records(path: str) -> Iterator[Any]:
    """The protobuf records of one offline ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a .wandb file"
    offset, pending = 7, b""
    while offset + 7 <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < 7:  # the rest of a block too small for a header is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0 and length == 0:
            break
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_runs(output_dir: str) -> List[Dict[str, Any]]:
    """Each offline attempt under ``<output_dir>/wandb``, oldest first: run id, exit code, history points."""
    attempts = []
    for path in sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "*.wandb"))):
        run_id, exit_code, points = None, None, Counter()
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "exit":
                exit_code = record.exit.exit_code
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                step = int(row.pop("_step"))
                points.update((name, step, float(value)) for name, value in row.items() if not name.startswith("_"))
        attempts.append({"run_id": run_id, "exit_code": exit_code, "points": points, "path": path})
    return attempts
