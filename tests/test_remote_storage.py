"""Checkpoints on non-local fsspec storage (``framework/checkpoint/storage_check.py``, the fsspec
paths of ``backends/checkpoint_io/sharded_checkpoint.py``) on 2 real gloo ranks.

A real S3-compatible server (moto's server mode, a separate process on localhost) serves
``s3://`` through s3fs to every rank: ``ddp`` and ``fsdp`` save there, resume from there on
both ranks, and ``load_weights`` reads the sharded checkpoint back in the test process.
``memory://`` (per process: rank 1 cannot see rank zero's files) is refused before step 1 on
every rank, naming why.
"""

import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from distributed import free_port, run_ranks
from tiny_transformer import TinyTransformer

from framework import Trainer, TrainerArguments
from framework.checkpoint import load_weights

pytest.importorskip("s3fs", reason="s3fs (setup.cfg dev extra) serves s3:// URLs")
pytest.importorskip("moto.server", reason="moto[server] (setup.cfg dev extra) is the local S3 server")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
BUCKET = "checkpoints"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def arguments(out: str, backend: str, save_dir: str, epochs: int, resume: Any = None) -> TrainerArguments:
    args = TrainerArguments(
        epochs=epochs,
        train_batch_size=16,
        backend=backend,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=out,
        sanity_val_steps=0,
    )
    args.checkpointer_args.save_dir = save_dir
    args.checkpointer_args.period = 1
    args.checkpointer_args.resume = resume
    return args


def full_weights(trainer: Trainer) -> Dict[str, torch.Tensor]:
    state = trainer.backend.strategy.unsharded(trainer.module.state_dict())
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def remote_scenarios(rank: int, out: str) -> Dict[str, Any]:
    dist.init_process_group("gloo")
    results: Dict[str, Any] = {}
    for backend in ("ddp", "fsdp"):
        save_dir = f"s3://{BUCKET}/{backend}"
        first = Trainer(TinyTransformer(samples=32), arguments(os.path.join(out, backend), backend, save_dir, 1))
        first.train()
        resumed = Trainer(TinyTransformer(samples=32), arguments(os.path.join(out, backend), backend, save_dir, 2, resume="auto"))
        resumed.train()
        results[backend] = {
            "loaded_from": resumed.checkpointer.loaded_from,
            "steps": (first.global_steps_finished, resumed.global_steps_finished),
            "weights": full_weights(resumed),
        }
        try:
            Trainer(TinyTransformer(samples=32), arguments(os.path.join(out, f"{backend}-memory"), backend, "memory://run", 1))
            results[backend]["memory"] = "accepted"
        except ValueError as error:
            results[backend]["memory"] = str(error)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free localhost port, and the environment that points s3fs at it."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
            time.sleep(0.2)
    environment = {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)  # the ranks (spawned) and s3fs in this process read it
    import fsspec

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = environment["AWS_ENDPOINT_URL"]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield fs
    fsspec.config.conf["s3"].pop("endpoint_url", None)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("remote"))
    return s3_server, run_ranks(remote_scenarios, out=out, timeout=400)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_every_rank_saves_to_and_resumes_from_a_shared_s3_server(runs, backend):
    fs, (rank0, rank1) = runs
    for rank in (rank0, rank1):
        assert rank[backend]["steps"] == (2, 4)
        assert rank[backend]["loaded_from"].startswith(f"s3://{BUCKET}/{backend}/checkpoint-000000002")
    for name, tensor in rank0[backend]["weights"].items():
        assert torch.equal(tensor, rank1[backend]["weights"][name]), name
    stored = sorted(path.rsplit("/", 1)[-1] for path in fs.ls(f"{BUCKET}/{backend}", refresh=True))
    assert [name for name in stored if name.startswith("checkpoint-")] == (
        ["checkpoint-000000002", "checkpoint-000000004"]
        if backend == "fsdp"
        else ["checkpoint-000000002.pt", "checkpoint-000000004.pt"]
    )
    if backend == "fsdp":  # every rank's shards, the index, the rest, the marker: all in the bucket
        shards = sorted(path.rsplit("/", 1)[-1] for path in fs.ls(f"{BUCKET}/fsdp/checkpoint-000000004", refresh=True))
        assert shards == [".complete", ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    module = TinyTransformer(samples=32)
    suffix = "" if backend == "fsdp" else ".pt"
    load_weights(module, f"s3://{BUCKET}/{backend}/checkpoint-000000004{suffix}")  # this process, no process group
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, rank0[backend]["weights"][name]), name


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_per_process_memory_storage_is_refused_before_step_one_on_every_rank(runs, backend):
    _, (rank0, rank1) = runs
    for rank in (rank0, rank1):
        message = rank[backend]["memory"]
        assert "checkpointer_args.save_dir='memory://run' cannot serve the" in message and backend in message
        assert "exists only inside the process that wrote it" in message
