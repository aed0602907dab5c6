"""A tiny transformer language model whose blocks live in an ``nn.ModuleList`` (FSDP units)."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from framework import ModuleInterface


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(
            width, 3 * width, bias=False
        )  # a key bias gets only rounding-noise gradients (softmax ignores it), which Adam would amplify
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(ModuleInterface):
    """Next-token prediction on random sequences; ``steps_per_epoch`` batches of ``train_batch_size``.

    Args:
        samples / length / vocab / width / depth: data and model size.
        lr: AdamW learning rate; a per-step linear-decay scheduler runs over the whole run.
    """

    def __init__(
        self,
        samples: int = 64,
        length: int = 8,
        vocab: int = 32,
        width: int = 16,
        depth: int = 2,
        lr: float = 1e-2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (samples, length + 1), generator=generator)
        self.train_ds = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.val_ds = TensorDataset(tokens[: samples // 2 - 1, :-1], tokens[: samples // 2 - 1, 1:])
        self.lr = lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        total = estimated_global_steps_per_epoch * epochs
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (total + 1))]

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.train_ds, batch_size=batch_size, sampler=sampler(self.train_ds))

    def get_val_dataloaders(self, sampler, batch_size):
        return DataLoader(self.val_ds, batch_size=batch_size, sampler=sampler(self.val_ds))

    def train_step(self, global_step, batch, device):
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_accuracy", (logits.argmax(-1) == targets).float().mean(), on_step=True)
        return loss

    def val_step(self, global_step, batch, device):
        tokens, targets = batch
        logits = self(tokens)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape).mean(1)
        return losses, (logits.argmax(-1) == targets).float().mean(1)
