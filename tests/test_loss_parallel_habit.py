"""A torchtitan user's own ``with loss_parallel():`` inside ``train_step`` (automatic optimization)
under ``model-parallel`` on 2 gloo ranks (tp 2), the head column-parallel with ``Shard(-1)``
logits: with ``uses_loss_parallel = True`` it trains as torchtitan's hand-written 2-D loop (the
strategy's loss parallelism survives the nested context); without it the run stops with an error
naming ``uses_loss_parallel``."""

import os

import pytest
import torch.distributed as dist
from test_tensor_parallel_plans import (
    BATCH,
    SAMPLES,
    TOLERANCE,
    LossParallelLlama,
    arguments,
    hand_written_loss_parallel,
    train,
)
from torch.distributed.tensor.parallel import loss_parallel

from framework import Trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class OwnContextLlama(LossParallelLlama):
    """torchtitan's train step as written: the loss inside the step's own ``loss_parallel()``."""

    def train_step(self, global_step, batch, device):
        with loss_parallel():
            loss = self.loss(batch)
        self.losses.append(loss.full_tensor().item())
        return loss


class WithoutTheSwitch(OwnContextLlama):
    """The same without ``uses_loss_parallel``: its validation keeps its own context too, so the first
    failure is the training backward, after the step's context closed."""

    uses_loss_parallel = False

    def val_step(self, global_step, batch, device):
        with loss_parallel():
            return super().val_step(global_step, batch, device)


def scenarios(rank: int, out: str) -> dict:
    dist.init_process_group("gloo")
    plain = dict(clip_grads=False, track_grad_norm=False)
    results = {"own": train(OwnContextLlama(), arguments(os.path.join(out, "own"), **plain))}
    results["hand"] = hand_written_loss_parallel(SAMPLES // BATCH)
    try:
        Trainer(WithoutTheSwitch(), arguments(os.path.join(out, "without"), **plain)).train()
        results["without"] = "trained"
    except Exception as error:  # what the user sees
        results["without"] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()
    return results


def test_a_train_steps_own_loss_parallel_works_with_the_switch_and_is_named_without_it(tmp_path):
    """Kills: the strategy's loss parallelism closed by the step's nested context before the backward
    (PyTorch's "got mixed torch.Tensor and DTensor"; mutant: _loss_for_the_loop without
    _reopen_loss_parallel), and PyTorch's words alone without the switch (mutant: explain_failure
    without the case)."""
    from distributed import run_ranks

    for result in run_ranks(scenarios, timeout=300, out=str(tmp_path)):
        run, hand = result["own"], result["hand"]
        assert run["losses"] == pytest.approx(hand["losses"], abs=TOLERANCE) and len(run["losses"]) == SAMPLES // BATCH
        for name, tensor in hand["weights"].items():
            assert (run["weights"][name] - tensor).abs().max().item() <= TOLERANCE, name
        said = result["without"]
        assert "set uses_loss_parallel = True on the module" in said and "aten.nll_loss_backward" in said, said[:2000]
