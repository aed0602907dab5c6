"""A small GPT (GPT-2 shaped: learned positions, pre-norm blocks, GELU MLP) on random tokens, as a plain
``nn.Module`` for hand-written loops and as a ``ModuleInterface`` for the framework (``benchmarks/gpu.py``).
Nothing is downloaded: the tokens are generated."""

import dataclasses
from typing import Dict

import torch
import torch.nn.functional as F
from gpu_flops import gpt_flops_per_token
from torch.utils.data import DataLoader, TensorDataset

from framework import ModuleInterface


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int = 12
    width: int = 768
    heads: int = 12
    sequence: int = 1024
    vocab: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64 (as nanoGPT does)

    @property
    def flops_per_token(self) -> int:
        return gpt_flops_per_token(self.layers, self.width, self.sequence, self.vocab)


SIZES: Dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, width=64, heads=2, sequence=32, vocab=128),  # the CPU tests' size
    "small": GPTConfig(),  # GPT-2 small, 124M parameters
    "medium": GPTConfig(layers=24, width=1024, heads=16),  # GPT-2 medium, 350M parameters
}


class Block(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = torch.nn.LayerNorm(config.width)
        self.qkv = torch.nn.Linear(config.width, 3 * config.width)
        self.proj = torch.nn.Linear(config.width, config.width)
        self.norm2 = torch.nn.LayerNorm(config.width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(config.width, 4 * config.width), torch.nn.GELU(), torch.nn.Linear(4 * config.width, config.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks (an ``nn.ModuleList``: the framework's
    sharding and compile units), a final norm and an untied output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab, config.width)
        self.position = torch.nn.Embedding(config.sequence, config.width)
        self.blocks = torch.nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = torch.nn.LayerNorm(config.width)
        self.head = torch.nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_data(config: GPTConfig, samples: int, seed: int = 0) -> TensorDataset:
    """``samples`` random sequences: (tokens, the same shifted by one)."""
    tokens = torch.randint(0, config.vocab, (samples, config.sequence + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW as GPT recipes use it (the same for the framework and the hand-written loop)."""
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


class GPTModule(ModuleInterface):
    """The GPT for the framework; ``flops_per_sample`` lets the ``Throughput`` callback report MFU.

    Example:
        module = GPTModule(SIZES["small"], samples=4096)
        Trainer(module, TrainerArguments(backend="sp-amp", train_batch_size=8, max_steps=50)).train()
    """

    def __init__(self, config: GPTConfig, samples: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(config)
        self.data = token_data(config, samples, seed)
        self.flops_per_sample = config.flops_per_token * config.sequence

    def sharding_units(self):
        return list(self.model.blocks)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [make_optimizer(self)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(
            self.data, batch_size=batch_size, sampler=sampler(self.data), pin_memory=torch.cuda.is_available(), drop_last=True
        )

    def get_val_dataloaders(self, sampler, batch_size):
        return None

    def train_step(self, global_step, batch, device):
        tokens, targets = batch
        return lm_loss(self.model(tokens), targets)
