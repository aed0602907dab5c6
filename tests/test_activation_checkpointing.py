"""``TrainerArguments.activation_checkpointing`` (``backends/strategies/activation_checkpointing.py``) on one
process, and with units built in ``configure_model()`` on sp, fsdp and model-parallel (one process and 2
ranks); the 2-rank ddp and fsdp memory runs are in ``test_memory_distributed.py``."""

import pytest
import torch
from logs import captured_log

from tiny_transformer import TinyTransformer
from toy import ToyModule, toy_args

from backends.strategies.activation_checkpointing import checkpoint_units
from framework import ModuleInterface, Trainer


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


class BuiltInConfigureModel(ModuleInterface):
    """Lightning's habit: the blocks are built in configure_model(), after the trainer exists."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator)

    def configure_model(self) -> None:
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(16, 4)

    def tensor_parallel_plan(self):  # model-parallel needs one (tp size 1 here: nothing is split)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.0.0": ColwiseParallel(), "blocks.1.0": RowwiseParallel()}

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler, batch_size):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset))

    def train_step(self, global_step, batch, device):
        hidden, labels = batch
        for block in self.blocks:
            hidden = block(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden), labels)


@pytest.mark.parametrize("backend", ["sp", "fsdp", "model-parallel"])
def test_configure_model_units_are_checkpointed_on_every_backend(tmp_path, backend):
    # Fault: the units were looked up before configure_model() built them -> "it has none" (mutant:
    # TrainingSetup.build without backend.build_model first). Same weights as without checkpointing.
    weights = {}
    for on in (False, True):
        torch.manual_seed(0)
        module = BuiltInConfigureModel()
        args = toy_args(tmp_path / f"{backend}-{on}", train_batch_size=16, backend=backend, activation_checkpointing=on)
        trainer = Trainer(module, args)
        trainer.train()
        assert all(getattr(block, "_activation_checkpointed", False) == on for block in module.blocks)
        state = trainer.backend.unsharded(module.state_dict())
        weights[on] = {name: value.detach().clone() for name, value in state.items()}
        trainer.close()
    assert weights[False].keys() == weights[True].keys()
    for name, value in weights[True].items():
        assert torch.allclose(value, weights[False][name], atol=1e-6), name


def checkpointed_ranks(rank: int, out: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for backend, extra in (("fsdp", {}), ("model-parallel", {"tensor_parallel_size": 2})):
        torch.manual_seed(0)
        module = BuiltInConfigureModel()
        args = toy_args(f"{out}/{backend}", train_batch_size=16, backend=backend, activation_checkpointing=True, **extra)
        trainer = Trainer(module, args)
        trainer.train()
        state = trainer.backend.unsharded(module.state_dict())
        results[backend] = {name: value.detach().clone() for name, value in state.items()}
        results[f"{backend} marked"] = all(getattr(block, "_activation_checkpointed", False) for block in module.blocks)
        trainer.close()  # the next trainer sets the process group up again
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
@pytest.mark.slow  # about 35 s on 2 shared cores: two trainers in each of 2 ranks
def test_configure_model_units_are_checkpointed_on_two_rank_fsdp_and_model_parallel_1x2(tmp_path):
    # 2 ranks: fsdp shards the meta-built, checkpointed units; model-parallel splits them over tp=2.
    from distributed import run_ranks

    torch.manual_seed(0)
    module = BuiltInConfigureModel()
    Trainer(module, toy_args(tmp_path / "sp", train_batch_size=16)).train()
    reference = module.state_dict()
    (first, second) = run_ranks(checkpointed_ranks, out=str(tmp_path))
    for backend in ("fsdp", "model-parallel"):
        assert first[f"{backend} marked"] and second[f"{backend} marked"]
        for name, value in first[backend].items():
            assert torch.allclose(value, reference[name], atol=1e-5), (backend, name)
