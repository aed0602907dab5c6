"""A small llama-style language model trained with tensor parallelism on a ("dp", "tp") mesh.

    torchrun --nproc_per_node=4 examples/model_parallel.py --backend model-parallel --trainer.tensor_parallel_size 2

Four processes form a 2x2 mesh: each pair splits every attention and feed-forward layer
(``tp``), and the two pairs train on different halves of each batch (``dp``, sharded with
FSDP2). ``python examples/model_parallel.py`` (one process, any backend) trains the same model.
The data is synthetic (no download): token sequences that follow a fixed rule, which the model
learns in a few steps. See docs/model-parallel.md.
"""

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from framework import ModuleInterface, Trainer, parse_config, seed_everything


@dataclass
class LlamaArguments:
    """The model section of the example's config."""

    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    """Attention heads: must be divisible by tensor_parallel_size (each tp rank computes n_heads / tp)."""
    hidden_dim: int = 128
    """SwiGLU width: must be divisible by tensor_parallel_size."""
    seq_len: int = 16
    samples: int = 256
    learning_rate: float = 1e-2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of each position's rotation, stacked: ``(2, seq_len, head_dim // 2)``."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), frequencies)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of features of ``x`` (``batch, seq, heads, head_dim``) by its position's angle."""
    cos, sin = tables[0][: x.shape[1], None, :], tables[1][: x.shape[1], None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv are column-split, so this rank holds n_heads / tp heads
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, tables), apply_rotary(k, tables)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), tables)
        return x + self.feed_forward(self.ffn_norm(x))


def rule_sequences(samples: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Token sequences where each token follows from the two before it (learnable, no download)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(samples, length, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, vocab_size, (samples, 2), generator=generator)
    for position in range(2, length):
        tokens[:, position] = (tokens[:, position - 1] * 3 + tokens[:, position - 2] + 1) % vocab_size
    return tokens


class TinyLlama(ModuleInterface):
    """Embeddings, ``n_layers`` blocks (RMSNorm, rotary attention, SwiGLU), a final norm and a head."""

    def __init__(self, config: Optional[LlamaArguments] = None) -> None:
        super().__init__()
        self.config = config = config or LlamaArguments()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config.dim, config.n_heads, config.hidden_dim) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rotary", rotary_tables(config.dim // config.n_heads, config.seq_len), persistent=False)
        tokens = rule_sequences(config.samples + config.samples // 4, config.seq_len + 1, config.vocab_size)
        self.train_ds = TensorDataset(tokens[: config.samples])
        self.val_ds = TensorDataset(tokens[config.samples :])

    def tensor_parallel_plan(self) -> Dict[str, ParallelStyle]:
        """Megatron's split of each block: q, k, v and the SwiGLU's w1, w3 by output columns (each tp
        rank its heads and its part of the hidden width), wo and w2 by input rows (their partial
        outputs summed over ``tp``). Embeddings, norms and the head stay whole on every tp rank."""
        return {
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w3": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rotary)
        return self.output(self.norm(x))

    def loss(self, batch: Any) -> torch.Tensor:
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        return self.loss(batch)

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, batch_size=batch[0].shape[0])
        return loss

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: Optional[int], epochs: int):
        return [torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)], []


DEFAULTS = ["--trainer.epochs", "3", "--trainer.train_batch_size", "32", "--trainer.clip_grads", "true"]
DEFAULTS += ["--trainer.disable_tqdm", "true", "--trainer.output_dir", "outputs/model_parallel", "--trainer.loggers", "[]"]


def main(argv: Optional[list] = None) -> float:
    argv = [*DEFAULTS, *(sys.argv[1:] if argv is None else argv)]
    config = parse_config({"model": LlamaArguments}, argv=argv, program="examples/model_parallel.py")
    seed_everything(config.trainer.seed)  # the same initial weights on every rank (and in every run)
    trainer = Trainer(module=TinyLlama(config.model), args=config.trainer)
    history = trainer.train()
    val_loss = history.latest("val_loss")
    backend = trainer.backend
    if trainer.is_main_process:
        print(
            f"{backend.world_size} process(es): data-parallel size {backend.data_parallel_size}, tensor-parallel size "
            f"{backend.world_size // backend.data_parallel_size}; final val_loss={val_loss:.4f} "
            f"(uniform guess: {math.log(config.model.vocab_size):.4f})"
        )
    return val_loss


if __name__ == "__main__":
    main()
