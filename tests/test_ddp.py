"""The ``ddp`` backend with 2 real gloo ranks: parity with ``sp``, gradient sync, data, launchers.

One 2-rank run (``ddp_run``) trains several scenarios in the same process group, and the
tests below check its results against single-process runs in the test process.
"""

import glob
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

from distributed import free_port, run_ranks
from toy import ToyModule, flat_parameters

from backends import DDP, FullPrecision, ResumableSampler, TrainerBackend
from framework import Trainer, TrainerArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TRAIN, N_VAL = 256, 63  # 63: validation does not split evenly over 2 ranks


class IndexedToy(ToyModule):
    """ToyModule whose samples carry their dataset index, so tests can see who got what."""

    def __init__(self, n_train: int = N_TRAIN, n_val: int = N_VAL, **kwargs) -> None:
        super().__init__(n_train=n_train, n_val=n_val, **kwargs)
        self.train_ds = TensorDataset(*self.train_ds.tensors, torch.arange(n_train))
        self.val_ds = TensorDataset(*self.val_ds.tensors, torch.arange(n_val))
        self.seen = {}  # epoch -> train indices, in the order this rank saw them
        self.val_outputs = None
        self.epoch = 0

    def on_begin_train_epoch(self, global_step, epoch):
        self.epoch = epoch

    def train_step(self, global_step, batch, device):
        x, y, index = batch
        self.seen.setdefault(self.epoch, []).extend(index.tolist())
        return F.cross_entropy(self.net(x), y)

    def val_step(self, global_step, batch, device):
        x, y, index = batch
        logits = self.net(x)
        return F.cross_entropy(logits.float(), y, reduction="none"), (logits.argmax(1) == y).float(), index

    def on_end_val_epoch(self, global_step, *outputs, key):
        self.val_outputs = [output.clone() for output in outputs]


class UnevenToy(IndexedToy):
    """Rank 1's train loader is 40 samples shorter than rank 0's (and 250 is odd per batch)."""

    def get_train_dataloader(self, sampler, batch_size):
        rank = int(os.environ.get("RANK", 0))
        dataset = self.train_ds if rank == 0 else Subset(self.train_ds, range(len(self.train_ds) - 40))
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset))


class UnusedParameterToy(IndexedToy):
    """Has a layer its train_step never uses: DDP needs find_unused_parameters=True."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.unused = torch.nn.Linear(4, 4)


class _Stream(IterableDataset):
    """An iterable without a length that yields a different number of samples per rank."""

    shards_itself = True  # each rank builds its own stream: the trainer must not split it again

    def __init__(self, dataset, count):
        self.dataset, self.count = dataset, count

    def __iter__(self):
        return (self.dataset[i] for i in range(self.count))


class StreamToy(IndexedToy):
    """Train loader without ``__len__``: rank 0 has 96 samples, rank 1 has 64."""

    def get_train_dataloader(self, sampler, batch_size):
        rank = int(os.environ.get("RANK", 0))
        return DataLoader(_Stream(self.train_ds, 96 if rank == 0 else 64), batch_size=batch_size)


def _counting_allreduce(backend: "CountingDDPBackend", bucket):
    """A DDP comm hook: count all-reduce rounds (bucket 0 of each), then all-reduce as usual."""
    if bucket.index() == 0:
        backend.allreduces += 1
    return default_hooks.allreduce_hook(None, bucket)


class CountingDDPBackend(TrainerBackend):
    """A backend plugin: DDP in fp32 that counts its gradient all-reduces with a comm hook."""

    def __init__(self) -> None:
        super().__init__(DDP(), FullPrecision())
        self.allreduces = 0

    def wrap_module(self, module):
        wrapped = super().wrap_module(module)
        wrapped.register_comm_hook(self, _counting_allreduce)
        return wrapped


def parity_args(backend: str, output_dir: str, **overrides) -> TrainerArguments:
    """Global batch 32 in micro-batches of 8: sp accumulates 4, each of 2 ddp ranks 2."""
    values = dict(
        epochs=2,
        train_batch_size=32,
        gpu_batch_size_limit=8,
        val_batch_size=5,
        clip_grads=True,
        max_grad_norm=0.3,  # below every step's norm (0.6-0.8): clipping acts on each step
        backend=backend,
        seed=0,
        log_every_n_steps=3,
        disable_tqdm=True,
        output_dir=output_dir,
    )
    values.update(overrides)
    return TrainerArguments(**values)


def _summary(trainer: Trainer, module: IndexedToy) -> dict:
    return {
        "params": flat_parameters(module),
        "history": [(r["name"], r["value"], r["step"], r["epoch"]) for r in trainer.history.records],
        "steps": trainer.global_steps_finished,
        "accumulation": trainer.gradient_accumulation,
        "seen": module.seen,
        "val_outputs": module.val_outputs,
    }


class WritesUnder:
    """An audit hook recording this process's file writes (opened for writing, created, renamed,
    removed) under ``root`` while ``active`` (audit hooks cannot be removed: switch it off)."""

    EVENTS = ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.link", "os.symlink", "shutil.rmtree")
    WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def __init__(self, root: str) -> None:
        self.root, self.active, self.seen = root, False, []

    def __call__(self, event: str, arguments: tuple) -> None:
        if not self.active or not (event in self.EVENTS or (event == "open" and (arguments[2] or 0) & self.WRITING)):
            return
        if isinstance(arguments[0], (str, bytes, os.PathLike)) and os.fsdecode(arguments[0]).startswith(self.root):
            self.seen.append((event, os.fsdecode(arguments[0])))


def ddp_scenarios(rank: int, tmp: str) -> dict:
    """Runs in each of 2 ranks; every trainer shares the one process group."""
    results = {}
    # 1. parity with sp, accumulation + clipping, comm-hook count; which rank writes files.
    module = IndexedToy()
    backend = CountingDDPBackend()
    writes = WritesUnder(tmp)
    sys.addaudithook(writes)
    writes.active = True
    trainer = Trainer(module, parity_args("ddp", os.path.join(tmp, "parity")), trainer_backend=backend)
    trainer.train()
    writes.active = False
    results["parity"] = dict(_summary(trainer, module), allreduces=backend.allreduces, world=backend.world_size)
    results["writes"] = writes.seen
    # 2. uneven data: odd dataset size, and loaders of different lengths per rank.
    module = UnevenToy(n_train=250)
    trainer = Trainer(module, parity_args("ddp", os.path.join(tmp, "uneven")))
    trainer.train()
    results["uneven"] = _summary(trainer, module)
    # 3. uneven iterable loaders without a length.
    module = StreamToy(scheduler=None)
    trainer = Trainer(module, parity_args("ddp", os.path.join(tmp, "stream"), epochs=1))
    trainer.train()
    results["stream"] = _summary(trainer, module)
    # 4. find_unused_parameters reaches DistributedDataParallel.
    module = UnusedParameterToy(scheduler=None)
    args = parity_args("ddp", os.path.join(tmp, "unused"), epochs=1, find_unused_parameters=True)
    trainer = Trainer(module, args)
    trainer.train()
    results["unused"] = dict(_summary(trainer, module), flag=trainer.wrapped_module.find_unused_parameters)
    # 5. fewer validation samples than ranks: rank 1 evaluates nothing.
    module = IndexedToy(n_val=1, scheduler=None)
    trainer = Trainer(module, parity_args("ddp", os.path.join(tmp, "tiny"), epochs=1))
    trainer.train()
    results["tiny_val"] = _summary(trainer, module)
    # 6. (last: the failure leaves the process group) unused parameters without the setting.
    try:
        Trainer(UnusedParameterToy(scheduler=None), parity_args("ddp", os.path.join(tmp, "nounused"), epochs=1)).train()
        results["unused_error"] = None
    except RuntimeError as error:
        results["unused_error"] = str(error)
    return results


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ddp"))
    ranks = run_ranks(ddp_scenarios, timeout=90, tmp=tmp)  # raises if any rank hangs
    return {"ranks": ranks, "tmp": tmp}


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    module = IndexedToy()
    trainer = Trainer(module, parity_args("sp", str(tmp_path_factory.mktemp("sp"))))
    trainer.train()
    return _summary(trainer, module)


@pytest.mark.distributed
def test_ddp_matches_sp_with_accumulation_and_clipping(ddp_run, sp_run):
    for result in ddp_run["ranks"]:
        parity = result["parity"]
        assert parity["world"] == 2
        assert (parity["accumulation"], sp_run["accumulation"]) == (2, 4)
        assert parity["steps"] == sp_run["steps"] == 16
        torch.testing.assert_close(parity["params"], sp_run["params"], rtol=1e-6, atol=1e-6)
    assert not torch.equal(sp_run["params"], flat_parameters(IndexedToy()))  # it did train


@pytest.mark.distributed
def test_no_sync_all_reduces_once_per_optimizer_step(ddp_run):
    for result in ddp_run["ranks"]:
        assert result["parity"]["accumulation"] == 2
        assert result["parity"]["allreduces"] == result["parity"]["steps"] == 16


@pytest.mark.distributed
def test_history_is_averaged_over_ranks_and_identical_on_every_rank(ddp_run, sp_run):
    rank0, rank1 = (result["parity"]["history"] for result in ddp_run["ranks"])
    assert rank0 == rank1
    # Each rank saw different samples; the ranks' mean is the mean over the global batch, which
    # is exactly what sp logged (same samples, same parameters at every step).
    assert [(name, step) for name, _, step, _ in rank0] == [(name, step) for name, _, step, _ in sp_run["history"]]
    for (name, value, _, _), (_, expected, _, _) in zip(rank0, sp_run["history"]):
        assert value == pytest.approx(expected, rel=1e-5, abs=1e-6), name


@pytest.mark.distributed
def test_validation_outputs_are_each_sample_once_in_dataset_order(ddp_run, sp_run):
    for result in ddp_run["ranks"]:
        losses, correct, index = result["parity"]["val_outputs"]
        assert index.tolist() == list(range(N_VAL))
        torch.testing.assert_close(losses, sp_run["val_outputs"][0], rtol=1e-5, atol=1e-6)
        assert torch.equal(correct, sp_run["val_outputs"][1])


@pytest.mark.distributed
def test_sampler_shuffles_per_epoch_and_shards_one_permutation(ddp_run, sp_run):
    rank0, rank1 = (result["parity"]["seen"] for result in ddp_run["ranks"])
    for epoch in (0, 1):
        assert len(rank0[epoch]) == len(rank1[epoch]) == N_TRAIN // 2
        assert sorted(rank0[epoch] + rank1[epoch]) == list(range(N_TRAIN))  # one permutation, split
        interleaved = [index for pair in zip(rank0[epoch], rank1[epoch]) for index in pair]
        assert interleaved == sp_run["seen"][epoch]  # the same order sp uses, dealt round-robin
    assert rank0[0] != rank0[1]


def test_distributed_sampler_same_order_on_every_rank_new_order_every_epoch():
    def shards(epoch):
        samplers = [ResumableSampler(range(11), shuffle=True, seed=3, rank=r, world_size=2) for r in range(2)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        return [list(sampler) for sampler in samplers]

    epoch0, epoch1 = shards(0), shards(1)
    assert shards(0) == epoch0  # deterministic: every rank computes the same permutation
    assert len(epoch0[0]) == len(epoch0[1]) == 6  # padded: no rank waits for another
    assert set(epoch0[0]) | set(epoch0[1]) == set(range(11))
    assert epoch0 != epoch1


@pytest.mark.distributed
def test_uneven_data_does_not_hang(ddp_run):
    rank0, rank1 = (result["uneven"] for result in ddp_run["ranks"])
    # rank 0: 125 samples = 16 micro-batches, rank 1: 105 = 14; both run the shorter 14 (7 steps).
    assert rank0["steps"] == rank1["steps"] == 14
    assert rank0["history"] == rank1["history"]
    torch.testing.assert_close(rank0["params"], rank1["params"], rtol=0, atol=0)
    indices = rank0["val_outputs"][2]
    assert indices.tolist() == list(range(N_VAL))


@pytest.mark.distributed
def test_fewer_validation_samples_than_ranks(ddp_run):
    for result in ddp_run["ranks"]:
        losses, correct, index = result["tiny_val"]["val_outputs"]
        assert index.tolist() == [0] and losses.shape == correct.shape == (1,)


@pytest.mark.distributed
def test_uneven_iterable_loaders_without_length_do_not_hang(ddp_run):
    rank0, rank1 = (result["stream"] for result in ddp_run["ranks"])
    # rank 1 runs out after 64 samples (8 micro-batches = 4 steps); rank 0 stops with it.
    assert rank0["steps"] == rank1["steps"] == 4
    assert len(rank0["seen"][0]) == len(rank1["seen"][0]) == 64
    torch.testing.assert_close(rank0["params"], rank1["params"], rtol=0, atol=0)


@pytest.mark.distributed
def test_unused_parameters_error_names_the_framework_setting(ddp_run):
    for result in ddp_run["ranks"]:
        message = result["unused_error"]
        assert message is not None and "--trainer.find_unused_parameters true" in message, message
        assert "did not receive a gradient" in message


@pytest.mark.distributed
def test_find_unused_parameters_is_passed_to_ddp(ddp_run):
    for result in ddp_run["ranks"]:
        assert result["unused"]["flag"] is True
        assert result["unused"]["steps"] == 8
    rank0, rank1 = (result["unused"]["params"] for result in ddp_run["ranks"])
    torch.testing.assert_close(rank0, rank1, rtol=0, atol=0)


@pytest.mark.distributed
def test_rank_zero_alone_writes_files(ddp_run):
    tmp = ddp_run["tmp"]
    assert os.path.exists(os.path.join(tmp, "parity", "metrics.csv"))
    assert glob.glob(os.path.join(tmp, "parity", "checkpoints", "*"))
    rank0, rank1 = (result["writes"] for result in ddp_run["ranks"])
    assert any(path.endswith("metrics.csv") for _, path in rank0)  # the probe sees writes
    assert rank1 == []  # rank 1 only reads (the storage check's token)


def _torchrun(*arguments: str, env=None, timeout: float = 90, cwd: str = ROOT) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *arguments]
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_example_runs_under_torchrun_and_only_rank_zero_prints(tmp_path):
    logs = tmp_path / "logs"
    result = _torchrun(
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        f"--log-dir={logs}",
        "--redirects=3",
        "examples/run.py",
        "--backend",
        "ddp",
        "--trainer.epochs",
        "2",
        "--trainer.disable_tqdm",
        "true",
        "--trainer.output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outputs = {}
    for rank in (0, 1):
        [directory] = glob.glob(str(logs / "**" / str(rank)), recursive=True)
        outputs[rank] = "".join(pathlib.Path(directory, name).read_text() for name in ("stdout.log", "stderr.log"))
    assert "final val_accuracy=" in outputs[0] and "INFO framework] epoch 2/2" in outputs[0]
    # Rank 1 prints nothing of its own: no log lines, progress, or results (torch's own
    # c10d warnings, if any, are not the framework's).
    assert "framework" not in outputs[1] and "epoch" not in outputs[1] and "val_accuracy" not in outputs[1]
    assert (tmp_path / "out" / "metrics.csv").exists()
    assert (tmp_path / "out" / "config.yaml").exists()


MULTI_NODE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import torch.distributed as dist
from toy import ToyModule, flat_parameters
from framework import Trainer, TrainerArguments

module = ToyModule(n_train=128, n_val=32)
trainer = Trainer(module, TrainerArguments(epochs=2, train_batch_size=32, backend="ddp", disable_tqdm=True,
                                           output_dir={out!r}, log_every_n_steps=2))
trainer.train()
gathered = trainer.backend.all_gather_object(flat_parameters(module))
print(f"rank={{trainer.backend.rank}} world={{trainer.backend.world_size}} steps={{trainer.global_steps_finished}} "
      f"same={{all(bool((g == gathered[0]).all()) for g in gathered)}}")
"""


@pytest.mark.distributed
def test_two_torchrun_launchers_train_together_as_two_nodes(tmp_path):
    script = tmp_path / "multinode.py"
    script.write_text(MULTI_NODE_SCRIPT.format(tests=os.path.join(ROOT, "tests"), out=str(tmp_path / "out")))
    port = free_port()
    common = ["--nnodes=2", "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(tmp_path / f"node{node}.log", "w") for node in (0, 1)]  # noqa: SIM115 - the launchers' output; closed below
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *common, f"--node_rank={node}", str(script)],
            cwd=ROOT,
            env=environment,
            stdout=logs[node],
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a hung launcher can be killed with its workers
        )
        for node in (0, 1)
    ]
    deadline = time.monotonic() + 60
    try:
        while any(launcher.poll() is None for launcher in launchers) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert [launcher.returncode for launcher in launchers] == [0, 0], "\n".join(outputs)
    assert "rank=0 world=2 steps=8 same=True" in outputs[0]
    assert "rank=1 world=2 steps=8 same=True" in outputs[1]
