"""A tiny torchtitan-style language model: blocks in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...,
rotary position embeddings from a complex64 ``freqs_cis`` buffer, and a hand-written true-bf16 loop.

As in torchtitan's llama, ``freqs_cis`` is a persistent complex buffer handed to every block,
which rotates queries and keys by multiplying them, viewed as complex numbers, with it.
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from framework import ModuleInterface


def precompute_freqs_cis(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """``exp(i * position * frequency)``: complex64 of shape (length, head_dim // 2)."""
    frequencies = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, length, heads, head_dim) by ``freqs_cis``, in fp32 complex, back in x's dtype."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = rotated * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class RotaryBlock(torch.nn.Module):
    """Pre-norm causal self-attention with rotary embeddings, then an MLP."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = torch.nn.LayerNorm(width)
        self.wqkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.wo = torch.nn.Linear(width, width, bias=False)
        self.ffn_norm = torch.nn.LayerNorm(width)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.SiLU(), torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.ffn(self.ffn_norm(x))


class TitanTransformer(ModuleInterface):
    """Next-token prediction on random tokens; AdamW, no scheduler; the train loader keeps
    dataset order (``sampler(dataset, shuffle=False)``) so a hand-written loop can follow it.

    Args:
        samples / length / vocab / width / depth: data and model size.
        lr: AdamW learning rate.
        seed: initialisation and data.
    """

    def __init__(
        self,
        samples: int = 32,
        length: int = 8,
        vocab: int = 32,
        width: int = 16,
        depth: int = 2,
        lr: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleDict({str(index): RotaryBlock(width) for index in range(depth)})
        self.norm = torch.nn.LayerNorm(width)
        self.output = torch.nn.Linear(width, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(width // 2, length), persistent=True)
        tokens = torch.randint(0, vocab, (samples, length + 1), generator=torch.Generator().manual_seed(seed))
        self.train_ds = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.lr = lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    def loss(self, batch: List[torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=self.lr)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds, shuffle=False))

    def train_step(self, global_step, batch, device):
        return self.loss(batch)


def to_true_bf16(module: torch.nn.Module) -> torch.nn.Module:
    """Floating parameters and buffers in bf16; complex and integer ones as they are."""
    return module._apply(lambda tensor: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)


def hand_written_true_bf16(
    steps: int, micro_batch: int, rank: int = 0, world_size: int = 1, model: Optional[TitanTransformer] = None
) -> Dict[str, torch.Tensor]:
    """A plain true-bf16 loop (weights, gradients and AdamW state in bf16, the complex buffer kept):
    rank ``r`` of ``world_size`` trains on samples ``r, r + world_size, ...`` in order, gradients
    are divided by the world size and summed over the ranks (as DDP does). Returns its final state dict."""
    model = to_true_bf16(model or TitanTransformer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.lr)
    tokens, targets = model.train_ds.tensors
    shard = list(range(rank, len(tokens), world_size))
    for step in range(steps):
        indices = shard[step * micro_batch : (step + 1) * micro_batch]
        model.loss([tokens[indices], targets[indices]]).backward()
        for parameter in model.parameters():
            if world_size > 1:
                parameter.grad.div_(world_size)
                dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
