"""A Llama-style language model trained with pipeline parallelism (docs/pipeline-parallel.md).

    torchrun --nproc_per_node=4 examples/pipeline_parallel.py --backend fsdp   # pp 2 x dp 2
    python examples/pipeline_parallel.py                                       # one process (sp)

Under torchrun the program asks for 2 pipeline stages (``--trainer.pipeline_parallel_size 2``, which a
flag given on the command line overrides): with 4 processes, 2 copies of a 2-stage pipeline each
train on their own half of every batch (``pp`` outermost, FSDP over ``dp``). Each batch of 32 splits
into micro-batches of 4 (``gpu_batch_size_limit``): the micro-batches are the accumulation cycle, and
the schedule (``pipeline_schedule``, default 1F1B) overlaps them across the stages. On one process the
same module trains with the same losses, micro-batch by micro-batch. The data is synthetic (no download).
"""

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from framework import ModuleInterface, Trainer, parse_config, seed_everything


@dataclass
class LlamaArguments:
    """The model section of the config."""

    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 4
    """Blocks: the pipeline splits them evenly between its stages (at least one block per stage)."""
    n_heads: int = 4
    hidden_dim: int = 128
    seq_len: int = 16
    samples: int = 256
    learning_rate: float = 1e-2


def rotary_tables(head_dim: int, seq_len: int) -> torch.Tensor:
    """cos and sin of each position's rotation: ``(2, seq_len, head_dim // 2)``."""
    angles = torch.outer(torch.arange(seq_len).float(), 1e4 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.stack([angles.cos(), angles.sin()])


def rotate(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    cos, sin = tables[0][: x.shape[1], None, :], tables[1][: x.shape[1], None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm block: rotary causal attention, then a SwiGLU feed-forward."""

    def __init__(self, dim: int, n_heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden_dim, bias=False), nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, seq, self.n_heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, tables), rotate(k, tables)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rule_sequences(samples: int, length: int, vocab_size: int) -> torch.Tensor:
    """Token sequences where each token follows from the two before it (learnable, no download)."""
    tokens = torch.zeros(samples, length, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, vocab_size, (samples, 2), generator=torch.Generator().manual_seed(0))
    for position in range(2, length):
        tokens[:, position] = (tokens[:, position - 1] * 3 + tokens[:, position - 2] + 1) % vocab_size
    return tokens


class PipelineLlama(ModuleInterface):
    """torchtitan's layout: ``tok_embeddings``, an ``nn.ModuleDict`` of blocks, ``norm``, ``output``.

    A pipeline stage holds some of these parts (the others are ``None``, or absent from ``layers``):
    ``forward`` runs the parts this stage holds, so the same module is the whole model on one process.
    """

    def __init__(self, config: Optional[LlamaArguments] = None) -> None:
        super().__init__()
        self.config = config = config or LlamaArguments()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): Block(config.dim, config.n_heads, config.hidden_dim) for i in range(config.n_layers)}
        )
        self.norm = nn.RMSNorm(config.dim, eps=1e-6)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rotary", rotary_tables(config.dim // config.n_heads, config.seq_len), persistent=False)
        tokens = rule_sequences(config.samples + config.samples // 4, config.seq_len + 1, config.vocab_size)
        self.train_ds, self.val_ds = TensorDataset(tokens[: config.samples]), TensorDataset(tokens[config.samples :])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            x = block(x, self.rotary)
        return self.output(self.norm(x)) if self.output is not None else x

    # The pipeline contract: what the first stage's forward takes, and the loss on the last stage.
    def pipeline_inputs(self, batch: Any) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        tokens = batch[0]
        return (tokens[:, :-1],), tokens[:, 1:]

    def pipeline_loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1).float(), target.flatten())

    # The same computation without a pipeline (sp, ddp, fsdp): one module runs every part.
    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        inputs, target = self.pipeline_inputs(batch)
        return self.pipeline_loss(self(*inputs), target)

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        loss = self.train_step(global_step, batch, device)
        self.log("val_loss", loss, batch_size=batch[0].shape[0])
        return loss

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: Optional[int], epochs: int):
        return [torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)], []


def default_flags() -> List[str]:
    flags = ["--trainer.epochs", "4", "--trainer.train_batch_size", "32", "--trainer.gpu_batch_size_limit", "4"]
    flags += ["--trainer.clip_grads", "true", "--trainer.disable_tqdm", "true", "--trainer.loggers", "[]"]
    flags += ["--trainer.output_dir", "outputs/pipeline_parallel"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        flags += ["--trainer.pipeline_parallel_size", "2"]
    return flags


def main(argv: Optional[List[str]] = None) -> float:
    argv = [*default_flags(), *(sys.argv[1:] if argv is None else argv)]
    config = parse_config({"model": LlamaArguments}, argv=argv, program="examples/pipeline_parallel.py")
    seed_everything(config.trainer.seed)  # the same initial weights on every rank (and in every run)
    trainer = Trainer(module=PipelineLlama(config.model), args=config.trainer)
    val_loss = trainer.train().latest("val_loss")
    if trainer.is_main_process:
        backend = trainer.backend
        print(
            f"{backend.world_size} process(es): pipeline stages {getattr(config.trainer, 'pipeline_parallel_size', 1) or 1}, "
            f"data-parallel size {backend.data_parallel_size}; final val_loss={val_loss:.4f} "
            f"(uniform guess: {math.log(config.model.vocab_size):.4f})"
        )
    return val_loss


if __name__ == "__main__":
    main()
