"""The hooks of the training loop: one definition shared by ModuleInterface and Callback."""

from typing import Any, Callable, Dict, List, Sequence

import torch


class TrainingHooks:
    """No-op hooks the trainer calls; override the ones you need.

    The trainer calls the module's hook first, then each callback's, in list order.
    ``global_step`` is always the number of optimizer steps finished so far.

    Example:
        >>> class PrintEpochs(TrainingHooks):
        ...     def on_begin_train_epoch(self, global_step, epoch):
        ...         print("epoch", epoch)
    """

    def on_begin_train(self, global_step: int) -> None:
        """Once, before the first epoch (after a resume: before the resumed one)."""

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        """Before each training epoch (``epoch`` counts from 0)."""

    def on_end_backward(self, global_step: int, loss: torch.Tensor) -> None:
        """After each micro-batch's backward (each chunk's under TBPTT); ``loss`` is unscaled."""

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        """After each micro-batch, with what ``train_step`` returned (loss first)."""

    def on_end_optimizer_step(self, global_step: int) -> None:
        """After each optimizer step (``global_step`` already counts it)."""

    def on_log_metrics(self, global_step: int, metrics: Dict[str, float]) -> None:
        """Whenever values are recorded (log points, epoch ends, evaluations), on every rank."""

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        """After each training epoch; ``outputs`` only with ``collect_train_outputs=True``."""

    def on_begin_val_epoch(self, global_step: int, key: str) -> None:
        """Before each validation loader (``key`` is its name, ``""`` for a single loader)."""

    def on_end_val_step(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each validation batch, with what ``val_step`` returned (also during the sanity
        check before training, as every validation hook: ``self.trainer.sanity_checking`` tells)."""

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each validation loader, with every ``val_step`` output gathered in dataset order."""

    def on_begin_test_epoch(self, global_step: int, key: str) -> None:
        """Before each test loader."""

    def on_end_test_step(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each test batch, with what ``test_step`` returned."""

    def on_end_test_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        """After each test loader, with every ``test_step`` output gathered in dataset order."""

    def on_end_train(self, global_step: int) -> None:
        """Once, after the last epoch (also after a stop request)."""


class HookDispatcher:
    """Calls a hook on the module, then on each callback, skipping those that keep the no-op.

    Looking up which targets override a hook is done once per name (and again after
    :meth:`refresh`), so a hook nobody implements costs one dict lookup per call.

    Args:
        module: the user's module (called first).
        callbacks: called after the module, in order.

    Example:
        >>> class Printer(TrainingHooks):
        ...     def on_end_optimizer_step(self, global_step):
        ...         print("step", global_step)
        >>> hooks = HookDispatcher(Printer(), [])
        >>> hooks.call("on_end_optimizer_step", 3)
        step 3
        >>> hooks.implemented("on_begin_train")
        False
    """

    def __init__(self, module: Any, callbacks: Sequence[Any]) -> None:
        self.module = module
        self.callbacks = callbacks
        self._bound: Dict[str, List[Callable[..., Any]]] = {}

    def refresh(self) -> None:
        """Look hooks up afresh (callbacks may have been added or changed)."""
        self._bound = {}

    def bound(self, name: str) -> List[Callable[..., Any]]:
        """The overriding implementations of hook ``name``, module first."""
        hooks = self._bound.get(name)
        if hooks is None:
            targets = (self.module, *self.callbacks)
            hooks = self._bound[name] = [getattr(target, name) for target in targets if overrides(target, name)]
        return hooks

    def implemented(self, name: str) -> bool:
        """True when the module or a callback overrides hook ``name``."""
        return bool(self.bound(name))

    def call(self, name: str, *arguments: Any, **keywords: Any) -> None:
        """Call every implementation of hook ``name``."""
        hooks = self._bound.get(name)
        for hook in self.bound(name) if hooks is None else hooks:
            hook(*arguments, **keywords)


def overrides(target: Any, hook: str) -> bool:
    """True when ``target`` implements ``hook`` beyond :class:`TrainingHooks`' no-op."""
    if hook in getattr(target, "__dict__", {}):
        return True
    implementation = getattr(type(target), hook, None)
    return implementation is not None and implementation is not getattr(TrainingHooks, hook)
