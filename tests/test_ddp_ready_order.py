"""``backends/strategies/ddp_ready_order.py``: on more than two ranks, a DDP process's first step sums
its gradients in the bucket layout of every later step, so a resumed process steps bitwise as the
run it continues; a backend's own comm hook is kept; nothing changes on two ranks.

The kit's ``resume_kill9/mlp`` at 4 ranks (``tests/test_conformance_four_ranks.py``) checks the same
through whole runs killed with ``kill -9``; the mutant ``mutant-ddp-first-step-layout`` (DDP as torch
builds it) fails there and passes every 2-rank cell."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from distributed import run_ranks

from backends import DDP


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 330 KiB of parameters: DDP's rebuild cuts two buckets under a 0.1 MiB cap
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 600), torch.nn.Tanh(), torch.nn.Linear(600, 64),
        torch.nn.Tanh(), torch.nn.Linear(64, 1),
    )  # fmt: skip


def _step(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> list:
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(wrapped(batch[0]), batch[1]).backward()
    gradients = [parameter.grad.clone() for parameter in wrapped.parameters()]
    optimizer.step()
    return gradients


def _continuing_and_fresh(wrap, rank: int) -> float:
    """Step 3 of a process that ran steps 1-2, against a fresh wrapper of the same weights (a resume):
    the largest difference of their step-3 gradients."""
    torch.manual_seed(100 + rank)
    batches = [(torch.randn(16, 32), torch.randn(16, 1)) for _ in range(3)]
    continuing = wrap(_model())
    continuing_optimizer = torch.optim.SGD(continuing.parameters(), lr=0.1)
    for batch in batches[:2]:
        _step(continuing, continuing_optimizer, batch)
    resumed = wrap(_model())
    resumed.module.load_state_dict(continuing.module.state_dict())
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    pairs = zip(_step(continuing, continuing_optimizer, batches[2]), _step(resumed, resumed_optimizer, batches[2]))
    return max(float((a - b).abs().max()) for a, b in pairs)


def _ignoring_one(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its first bias left out of DDP's reduction (the first layer's: ready last)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["0.bias"])
    return module


def _counting_hook(state: list, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def _ranks_body(rank: int, bucket_cap_mb: float) -> dict:
    strategy = DDP(wrap_options={"bucket_cap_mb": bucket_cap_mb})
    strategy.setup()
    try:
        result = {"framework": _continuing_and_fresh(strategy.wrap_module, rank)}
        result["torch"] = _continuing_and_fresh(lambda module: DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb), rank)
        result["ignoring a parameter"] = _continuing_and_fresh(lambda module: strategy.wrap_module(_ignoring_one(module)), rank)
        # the docs' pattern (docs/backends.md): a backend registers its own hook right after wrap_module
        wrapped, calls = strategy.wrap_module(_model()), []
        wrapped.register_comm_hook(calls, _counting_hook)
        _step(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), (torch.randn(4, 32), torch.randn(4, 1)))
        result["own hook calls"] = len(calls)
        wrapped = strategy.wrap_module(_model())  # a built-in hook (C++): kept too
        wrapped._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        _step(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), (torch.randn(4, 32), torch.randn(4, 1)))
        result["built-in hook"] = wrapped._get_ddp_logging_data().get("comm_hook")
        unused = DDP(find_unused_parameters=True)
        unused.setup()  # joins the process group made above
        wrapped = unused.wrap_module(_model())
        wrapped(torch.randn(4, 32)).sum().backward()
        result["hook with find_unused_parameters"] = wrapped._get_ddp_logging_data().get("comm_hook")
        return result
    finally:
        strategy.teardown()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.1])  # DDP's default: one rebuilt bucket; 0.1 MiB: two
def test_on_4_ranks_a_resumed_first_step_sums_its_gradients_as_the_run_it_continues(bucket_cap_mb):
    results = run_ranks(_ranks_body, world_size=4, timeout=120, bucket_cap_mb=bucket_cap_mb)
    for result in results:
        assert result["framework"] == 0.0, results  # bitwise
        assert result["ignoring a parameter"] == 0.0, results  # DDP leaves it out of its buckets: so does the order
        assert result["torch"] > 0.0, results  # DDP as torch builds it: the fault this catches (about 1e-8)
        assert result["own hook calls"] >= 1, results  # the backend's hook reduced the step, not ours
        assert result["built-in hook"] == "BuiltinCommHookType.ALLREDUCE", results
        assert result["hook with find_unused_parameters"] is None, results  # no rebuild, one layout: nothing to do


def _two_ranks_body(rank: int) -> int:
    strategy = DDP()
    strategy.setup()
    try:
        wrapped = strategy.wrap_module(_model())
        wrapped(torch.randn(4, 32)).sum().backward()
        return wrapped._get_ddp_logging_data().get("comm_hook")
    finally:
        strategy.teardown()


@pytest.mark.distributed
def test_on_2_ranks_ddp_reduces_as_torch_builds_it():
    """``a + b == b + a``: two ranks sum alike in any layout, so DDP's own C++ reduction stays."""
    assert run_ranks(_two_ranks_body, world_size=2, timeout=60) == [None, None]
