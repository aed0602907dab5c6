"""``TrainerArguments.activation_checkpointing`` (``backends/strategies/activation_checkpointing.py``) on one
process; the 2-rank ddp and fsdp runs are in ``test_memory_distributed.py``."""

import pytest
import torch
from logs import captured_log

from tiny_transformer import TinyTransformer
from toy import ToyModule, toy_args

from backends.strategies.activation_checkpointing import checkpoint_units
from framework import Trainer


class DropoutTransformer(TinyTransformer):
    """Dropout inside the blocks: the recomputed forward must draw the same masks."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.mlp.insert(2, torch.nn.Dropout(0.3))


def saved_for_backward(module: torch.nn.Module, tokens: torch.Tensor) -> tuple:
    """(bytes autograd keeps for backward, gradients) of one forward/backward."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    torch.manual_seed(3)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = module(tokens).square().mean()
    bytes_before_backward = sum(saved)
    loss.backward()
    return bytes_before_backward, {name: p.grad.clone() for name, p in module.named_parameters()}


def test_gradients_equal_without_it_and_fewer_activations_are_kept():
    tokens = TinyTransformer().train_ds.tensors[0][:8]
    plain, checkpointed = DropoutTransformer(), DropoutTransformer()
    keys = list(checkpointed.state_dict())
    assert checkpoint_units(checkpointed) == list(checkpointed.blocks)
    assert list(checkpointed.state_dict()) == keys  # names and checkpoints unchanged
    plain_bytes, plain_grads = saved_for_backward(plain, tokens)
    kept_bytes, grads = saved_for_backward(checkpointed, tokens)
    assert max((grads[name] - plain_grads[name]).abs().max().item() for name in grads) <= 1e-6
    assert kept_bytes < plain_bytes / 2  # each block keeps its input only
    assert checkpoint_units(checkpointed) == list(checkpointed.blocks)  # a second call wraps nothing twice
    with torch.no_grad():
        assert torch.equal(checkpointed.eval()(tokens), plain.eval()(tokens))


def test_training_with_it_ends_with_the_same_weights_and_the_log_says_it_once(tmp_path):
    weights, said = {}, {}
    for on in (False, True):
        args = toy_args(tmp_path / str(on), epochs=1, train_batch_size=16, activation_checkpointing=on, log_level="INFO")
        trainer = Trainer(TinyTransformer(), args)
        with captured_log() as messages:
            trainer.train()
        weights[on] = torch.cat([p.detach().flatten() for p in trainer.module.parameters()])
        said[on] = [message for message in messages if message.startswith("activation checkpointing")]
    assert (weights[True] - weights[False]).abs().max().item() <= 1e-6
    units = len(trainer.module.blocks)
    assert said == {False: [], True: [f"activation checkpointing: {units} units (Block) recompute their activations in backward"]}


def test_a_module_without_units_is_refused_naming_sharding_units(tmp_path):
    trainer = Trainer(ToyModule(), toy_args(tmp_path, activation_checkpointing=True))
    with pytest.raises(ValueError, match=r"unit of ToyModule in backward, but it has none: sharding_units\(\) returned none"):
        trainer.train()
