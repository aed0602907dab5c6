"""The model-parallel example's llama whose ``forward`` runs the parts a pipeline stage holds (torchtitan's way)."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from model_parallel import LlamaArguments, TinyLlama

sys.path.pop(0)


class StagedLlama(TinyLlama):
    """Embeddings, ``n_layers`` blocks (a ``ModuleList``, or a ``ModuleDict`` with ``blocks="dict"``), norm, head."""

    def __init__(self, n_layers: int = 4, blocks: str = "list") -> None:
        torch.manual_seed(0)
        super().__init__(LlamaArguments(vocab_size=32, dim=16, n_layers=n_layers, n_heads=2, hidden_dim=32, seq_len=8))
        if blocks == "dict":
            self.layers = torch.nn.ModuleDict({str(index): layer for index, layer in enumerate(self.layers)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values() if isinstance(self.layers, torch.nn.ModuleDict) else self.layers:
            x = layer(x, self.rotary)
        return self.output(self.norm(x)) if self.output is not None else x


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
