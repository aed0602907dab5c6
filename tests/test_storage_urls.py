"""Checkpoint storage URLs checked before step 1 (framework/checkpoint/storage_check.py): a protocol
fsspec does not know named with its option, a caching layer under a sharded backend refused."""

import pytest

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments
from framework.config.cli import ConfigError, parse_config


class CountingToy(ToyModule):
    def __init__(self) -> None:
        super().__init__(n_train=32, n_val=8, hidden=8)
        self.steps = 0

    def train_step(self, global_step, batch, device):
        self.steps += 1
        return super().train_step(global_step, batch, device)


def test_an_unknown_protocol_names_the_field(tmp_path):
    """Kills: the URL reaching fsspec unchecked ("Protocol not known: MEMORY", naming no field)."""
    with pytest.raises(ValueError) as raised:
        DefaultCheckpointerArguments(save_dir="MEMORY://run", period=1)
    message = str(raised.value)
    assert message.startswith("checkpointer.save_dir='MEMORY://run': fsspec knows no protocol 'MEMORY'"), message
    assert "did you mean 'memory'" in message
    with pytest.raises(ConfigError, match=r"checkpointer.load_dir='nope://x': fsspec knows no protocol 'nope'"):
        parse_config(argv=["--checkpointer.load_dir", "nope://x"])


def test_a_cache_layer_under_fsdp_is_refused_before_step_one(tmp_path):
    """Kills: simplecache:: accepted for sharded saves (the run trains, then its first save dies with
    FileNotFoundError on its temporary name)."""
    module = CountingToy()
    url = f"simplecache::file://{tmp_path}/checkpoints"
    args = toy_args(tmp_path, DefaultCheckpointerArguments(save_dir=url, period=1), backend="fsdp")
    with pytest.raises(ValueError, match=r"cannot serve the fsdp backend: .*\(simplecache::\)") as raised:
        Trainer(module, args).train()
    assert "save_dir" in str(raised.value) and module.steps == 0


@pytest.mark.parametrize("layer", ["dir", "zip", "reference"])
def test_a_chained_url_of_another_family_is_refused_with_the_arguments(tmp_path, layer):
    """Kills: only cache prefixes refused (``dir::file://`` on fsdp trained, then crashed at its first save:
    'NoneType' object has no attribute 'startswith'). Refused when the arguments are made, by name."""
    url = f"{layer}::file://{tmp_path}/checkpoints"
    with pytest.raises(ValueError) as raised:
        DefaultCheckpointerArguments(save_dir=url, period=1)
    message = str(raised.value)
    assert message.startswith(f"checkpointer.save_dir='{url}': a chained fsspec URL through {layer}:: is not supported")
    assert "s3://" in message and "simplecache::" in message, message
    with pytest.raises(ConfigError, match=rf"checkpointer.load_dir='{layer}::file:///x': a chained fsspec URL"):
        parse_config(argv=["--checkpointer.load_dir", f"{layer}::file:///x"])
    DefaultCheckpointerArguments(save_dir=f"simplecache::file://{tmp_path}/c", period=1)  # a cache layer: still allowed here
