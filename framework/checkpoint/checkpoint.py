"""Checkpoint: the bundle of module, trainer and backend states, and its on-disk format."""

from dataclasses import dataclass, field
from typing import Any, Dict

FORMAT_NAME = "framework-checkpoint"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    """Everything needed to continue a run exactly where it stopped.

    On disk (``to_dict``) it is a plain dict of tensors, numbers, strings, lists and dicts,
    written with ``torch.save`` and read with ``torch.load(weights_only=True)``:
    ``{"format": "framework-checkpoint", "version": 1, "global_step", "epoch", "metrics",
    "module", "trainer", "backend"}``.

    Attributes:
        module_state: ``ModuleInterface.get_state()`` (the model weights, plus user extras).
        trainer_state: ``Trainer.state_dict()`` (counters, optimizers, schedulers, RNG,
            sampler, callbacks, metric history).
        backend_state: ``TrainerBackend.state_dict()`` (the gradient scaler).
        global_step: optimizer steps finished when it was taken.
        epoch: epochs finished when it was taken.
        metrics: the metric values recorded at ``global_step``, i.e. measured on these weights
            (``metric`` among them ranks the checkpoint for best-k retention).

    Example:
        >>> ckpt = Checkpoint(module_state={"model": {}}, trainer_state={}, backend_state={}, global_step=10)
        >>> Checkpoint.from_dict(ckpt.to_dict()).global_step
        10
    """

    module_state: Dict[str, Any]
    trainer_state: Dict[str, Any]
    backend_state: Dict[str, Any]
    global_step: int = 0
    epoch: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The plain dict written to storage (tensors, numbers, strings, lists, dicts only)."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "metrics": dict(self.metrics),
            "module": self.module_state,
            "trainer": self.trainer_state,
            "backend": self.backend_state,
        }

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Checkpoint":
        """Inverse of :meth:`to_dict`; rejects dicts that are not checkpoints of this format."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ValueError("not a framework checkpoint (missing format marker)")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint format version {data.get('version')!r}; this framework reads {FORMAT_VERSION}")
        return cls(
            module_state=data["module"],
            trainer_state=data["trainer"],
            backend_state=data["backend"],
            global_step=int(data["global_step"]),
            epoch=int(data["epoch"]),
            metrics=dict(data["metrics"]),
        )
