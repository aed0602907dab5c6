"""A torchtitan-layout llama (embeddings, an ``nn.ModuleDict`` of blocks, norm, head) that trains on any
backend and on a pipeline: ``train_step`` for sp/ddp/fsdp, ``pipeline_inputs`` / ``pipeline_loss`` for
``pipeline_parallel_size > 1`` (same loss). The data is the example's rule sequences (no download)."""

from typing import Any, Dict, List, Tuple

import torch
from staged_llama import StagedLlama, token_loss


class PipelineLlama(StagedLlama):
    """4 blocks in an ``nn.ModuleDict``; AdamW; every step's loss logged by the framework as ``train_loss``."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2) -> None:
        super().__init__(n_layers=n_layers, blocks="dict")
        self.lr = lr

    def pipeline_inputs(self, batch: Any) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
        tokens = batch[0]
        return (tokens[:, :-1],), tokens[:, 1:]

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, target)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: Any, epochs: int):
        return [torch.optim.AdamW(self.parameters(), lr=self.lr)], []


def full_weights(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole (DTensors gathered: call on every rank of the stage)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in module.named_parameters()}


def losses(history: Any, name: str = "train_loss") -> List[float]:
    return [record["value"] for record in history.records if record["name"] == name]


class MetaLlama(PipelineLlama):
    """The same model with its layers built in ``configure_model()`` (on the meta device under fsdp and
    model-parallel: a stage never holds the other stages' layers); its RMSNorms get a ``reset_parameters``."""

    def __init__(self, n_layers: int = 4, lr: float = 1e-2) -> None:
        super().__init__(n_layers=n_layers, lr=lr)
        self.n_layers = n_layers
        self.tok_embeddings = self.layers = self.norm = self.output = None  # built by configure_model

    def configure_model(self) -> None:
        from model_parallel import Block, RMSNorm

        config = self.config
        self.tok_embeddings = torch.nn.Embedding(config.vocab_size, config.dim)
        blocks = (Block(config.dim, config.n_heads, config.hidden_dim) for _ in range(self.n_layers))
        self.layers = torch.nn.ModuleDict({str(index): block for index, block in enumerate(blocks)})
        self.norm = RMSNorm(config.dim)
        self.output = torch.nn.Linear(config.dim, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters = (lambda norm: lambda: torch.nn.init.ones_(norm.weight))(module)


class LoggingLlama(PipelineLlama):
    """Logs its loss with ``self.log`` inside ``pipeline_loss`` (the last stage under a pipeline), and
    trains through the same two methods on one process."""

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = token_loss(logits, target)
        self.log("token_loss", loss, on_step=True, on_epoch=True, batch_size=target.shape[0])
        return loss

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        inputs, target = self.pipeline_inputs(batch)
        return self.pipeline_loss(self(*inputs), target)
