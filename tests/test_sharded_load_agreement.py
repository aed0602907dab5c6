"""A sharded checkpoint read where one rank's own checks fail (a tensor of another shape on that
rank alone, as one pipeline stage's optimizer state keyed by index would be) stops every rank at
once, each naming the failure: no rank enters DCP's collective read alone and waits there for a
peer that already raised (``sharded_checkpoint.load``'s ``agree``, wired by the ``FSDP`` strategy).

The process group's timeout is 20 s: without the agreement, rank 0 waits in DCP's collectives
until then and fails with a timeout instead (the mutant: ``agree`` not called)."""

import datetime
import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

from backends import FSDP
from backends.checkpoint_io import CheckpointIO, sharded_checkpoint


def _read_with_one_rank_reshaped(rank: int, out: str) -> Dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    try:
        path = os.path.join(out, "checkpoint-000000001")
        state = {"module": {"weight": torch.arange(4.0)}, "trainer": {}}
        write = sharded_checkpoint.prepare_save(
            path, state, CheckpointIO(), is_main=rank == 0, distributed=True, on_rank_zero=lambda make, what: make()
        )
        write()
        strategy = FSDP()
        strategy.setup()  # joins the group above
        width = 5 if rank == 1 else 4  # rank 1's module has another shape: only its own check fails
        started = datetime.datetime.now()
        try:
            strategy.load_checkpoint(path, CheckpointIO(), lambda: {"module": {"weight": torch.zeros(width)}, "trainer": {}})
            result = "read"
        except Exception as error:
            result = f"{type(error).__name__}: {error}"
        return {"result": result, "seconds": (datetime.datetime.now() - started).total_seconds()}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_read_failing_on_one_rank_stops_every_rank_at_once_naming_it(tmp_path):
    rank0, rank1 = run_ranks(_read_with_one_rank_reshaped, world_size=2, timeout=90, out=str(tmp_path))
    assert rank1["result"].startswith("ValueError") and "(4,) in the checkpoint, (5,) in this run" in rank1["result"], rank1
    assert rank0["result"].startswith("RuntimeError: rank 1 cannot read it: ValueError"), rank0
    assert "(4,) in the checkpoint, (5,) in this run" in rank0["result"], rank0
    assert rank0["seconds"] < 15 and rank1["seconds"] < 15, (rank0, rank1)  # not the group's 20 s timeout
