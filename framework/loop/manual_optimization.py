"""Manual optimization: ``train_step`` runs its own backward passes and optimizer steps.

A module sets ``automatic_optimization = False`` and, inside ``train_step``, calls
``self.optimizers()``, ``self.manual_backward(loss)``, ``self.clip_gradients(...)`` and
``self.lr_schedulers()``, as in Lightning. The trainer then only feeds batches, counts
steps (one per batch), logs, validates and saves. Every call still goes through the
backend: loss scaling and unscaling under fp16, and DDP's gradient sync for each backward.
"""

from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from backends import TrainerBackend


class ManualOptimizer:
    """An optimizer as ``train_step`` sees it under manual optimization.

    ``step`` goes through the backend's precision (a ``GradScaler`` step and update under
    fp16; a plain ``optimizer.step()`` otherwise). Everything else (``zero_grad``,
    ``param_groups``, ``state_dict``...) is the wrapped optimizer's own.

    Args:
        optimizer: the optimizer ``get_optimizers_schedulers`` returned.
        backend: the trainer's backend.

    Example:
        >>> from backends import build_backend
        >>> backend = build_backend("sp"); backend.setup()
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> optimizer = ManualOptimizer(torch.optim.SGD([weight], lr=0.5), backend)
        >>> weight.sum().backward()
        >>> optimizer.step(); optimizer.zero_grad()
        True
        >>> weight.detach()
        tensor([0.5000, 0.5000])
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, backend: TrainerBackend, wrapped: Optional[torch.nn.Module] = None
    ) -> None:
        self.optimizer = optimizer
        self._backend = backend
        self._wrapped = wrapped

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        """Step (through the precision); False when fp16 loss scaling skipped the update."""
        stepped = self._backend.step_optimizers([self.optimizer], closure)
        if self._wrapped is not None:
            self._backend.refresh_parameters(self._wrapped)  # FSDP: gather the updated shards
        # train_step runs in one autocast region, whose cache keeps each weight's bf16/fp16 copy until
        # the region ends: a forward after this step would compute with the weights before it
        torch.clear_autocast_cache()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"ManualOptimizer({self.optimizer!r})"


class ManualOptimization:
    """What the module's manual-optimization methods delegate to, while a trainer runs it.

    Args:
        backend: the trainer's backend.
        optimizers: the optimizers ``get_optimizers_schedulers`` returned.
        schedulers: the schedulers it returned (never stepped by the trainer in this mode).
        wrapped: the module wrapper training forwards go through (DDP re-arms it per backward).
        on_backward: called with each loss after its backward (the ``on_end_backward`` hooks).

    Example:
        >>> from backends import build_backend
        >>> backend = build_backend("sp"); backend.setup()
        >>> weight = torch.nn.Parameter(torch.ones(1))
        >>> manual = ManualOptimization(backend, [torch.optim.SGD([weight], lr=1.0)], [], None, lambda loss: None)
        >>> manual.backward((weight * 3).sum()); float(weight.grad)
        3.0
    """

    def __init__(
        self,
        backend: TrainerBackend,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        wrapped: Optional[torch.nn.Module],
        on_backward: Callable[[torch.Tensor], None],
    ) -> None:
        self.backend = backend
        self.optimizers = [ManualOptimizer(optimizer, backend, wrapped) for optimizer in optimizers]
        self.schedulers = list(schedulers)
        self.wrapped = wrapped
        self.on_backward = on_backward

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss``: scaled under fp16, gradients synced under DDP and FSDP.

        ``args`` and ``kwargs`` go to ``Tensor.backward`` (``retain_graph=True`` for a second
        backward through the same graph, ``inputs=...``).
        """
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ValueError(
                "manual_backward(loss) needs a tensor that requires grad; got "
                + ("a tensor with requires_grad=False" if isinstance(loss, torch.Tensor) else type(loss).__name__)
            )
        if self.wrapped is not None:
            self.backend.prepare_for_backward(self.wrapped, loss)
        self.backend.backward(loss, *args, **kwargs)
        if self.wrapped is not None:
            self.backend.refresh_parameters(self.wrapped)
        self.on_backward(loss.detach())

    def clip_gradients(
        self, optimizer: Union[ManualOptimizer, torch.optim.Optimizer], max_norm: Optional[float], max_value: Optional[float]
    ) -> Optional[torch.Tensor]:
        """Unscale ``optimizer``'s gradients (fp16), clip them by value and/or total norm; returns the norm."""
        if max_norm is None and max_value is None:
            raise ValueError("clip_gradients(optimizer, max_norm=None, max_value=None) clips nothing; set max_norm or max_value")
        for name, limit in (("max_norm", max_norm), ("max_value", max_value)):
            if limit is not None and not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0):
                raise ValueError(f"clip_gradients({name}={limit!r}) is invalid; allowed: a number > 0 or None")
        raw = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
        self.backend.unscale_gradients([raw])
        parameters = [p for group in raw.param_groups for p in group["params"] if p.grad is not None]
        return self.backend.clip_gradients(parameters, max_norm, max_value)  # whatever the parameters' meshes


def one_or_list(items: List[Any]) -> Any:
    """A single item alone, several as a list, none as None (as Lightning's ``optimizers()``)."""
    if not items:
        return None
    return items[0] if len(items) == 1 else list(items)
