"""WeightAveraging: an averaged copy of the module's weights, kept beside training
(``torch.optim.swa_utils.AveragedModel``); the base of :class:`EMA` and :class:`SWA`."""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.optim.swa_utils import AveragedModel

from framework.callbacks.base import Callback


class _Tensors(torch.nn.Module):
    """The module's parameters and buffers, in ``parameters()`` / ``buffers()`` order, and
    nothing else: what :class:`AveragedModel` copies (not the module, whose attributes may
    hold datasets and the trainer)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(list(module.parameters()))
        for index, buffer in enumerate(module.buffers()):
            self.register_buffer(f"buffer_{index}", buffer)


class WeightAveraging(Callback):
    """Keeps ``self.averaged``, an :class:`~torch.optim.swa_utils.AveragedModel` of the
    trainer's module, and swaps it in for validation and test.

    Subclasses say when to average (:meth:`should_update`); :meth:`update` averages the
    current weights in (the first update copies them). Under ``ddp`` every rank averages the
    same weights, so the average is identical on every rank; under ``fsdp`` each rank averages
    its own shards (the averaged tensors are sharded like the parameters, no gather). The
    average and how many updates it holds are saved in checkpoints (sharded ones too), so a
    resumed run continues exactly.

    Args:
        multi_avg_fn: ``AveragedModel``'s ``multi_avg_fn`` (None: the running mean, as SWA).
        use_buffers: average the buffers too (batch-norm statistics); else they are copied.
        use_for_validation: evaluate the averaged weights in validation and test (the
            training weights come back after each loader).

    Example:
        class EveryEpoch(WeightAveraging):
            def on_end_train_epoch(self, global_step, *outputs):
                self.update()
    """

    def __init__(
        self,
        multi_avg_fn: Optional[Callable[..., None]] = None,
        use_buffers: bool = False,
        use_for_validation: bool = True,
    ) -> None:
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = use_buffers
        self.use_for_validation = use_for_validation
        self.averaged: Optional[AveragedModel] = None
        self._live: Optional[_Tensors] = None
        self._swapped = False

    @property
    def module(self) -> torch.nn.Module:
        """The averaged tensors (``module.params``: the parameters in ``parameters()`` order);
        use :meth:`averaged_state_dict` for them under the module's own names."""
        if self.averaged is None:
            raise RuntimeError(f"{type(self).__name__} holds no average yet: pass it to a Trainer and train")
        return self.averaged.module

    @property
    def updates(self) -> int:
        """How many times weights were averaged in (0: none yet)."""
        return 0 if self.averaged is None else int(self.averaged.n_averaged.item())

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        current = [id(parameter) for parameter in trainer.module.parameters()]
        if self._live is None or current != [id(parameter) for parameter in self._live.parameters()]:
            if self.updates:  # fsdp replaced the parameters after the average began
                raise RuntimeError(f"{type(self).__name__}: the module's parameters changed after averaging began")
            self._live = _Tensors(trainer.module)
            average = None if self.multi_avg_fn is None else _on_local_shards(self.multi_avg_fn, trainer.backend.local_shards)
            self.averaged = AveragedModel(self._live, multi_avg_fn=average, use_buffers=self.use_buffers)
            self.averaged.requires_grad_(False)

    def should_update(self, global_step: int) -> bool:
        """Whether the weights after optimizer step ``global_step`` are averaged in."""
        return False

    def on_end_optimizer_step(self, global_step: int) -> None:
        if self.should_update(global_step):
            self.update()

    def update(self) -> None:
        """Average the module's current weights in (the first time: copy them)."""
        averaged, live = self._ready()
        averaged.update_parameters(live)

    def _ready(self) -> Tuple[AveragedModel, _Tensors]:
        if self.averaged is None or self._live is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: pass it to a Trainer (callbacks=[...])")
        return self.averaged, self._live

    def _pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        averaged, live = self._ready()
        live_tensors = list(live.parameters()) + (list(live.buffers()) if self.use_buffers else [])
        averaged_tensors = list(averaged.module.parameters()) + (list(averaged.module.buffers()) if self.use_buffers else [])
        return list(zip(live_tensors, averaged_tensors))

    @torch.no_grad()
    def _swap(self) -> None:
        for live, averaged in self._pairs():
            kept = live.detach().clone()
            live.detach().copy_(averaged)
            averaged.detach().copy_(kept)
        self._swapped = not self._swapped

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the module inside the block, the training weights after.

        Example:
            with ema.applied():
                predictions = trainer.predict()
        """
        swap = self.updates > 0 and not self._swapped
        if swap:
            self._swap()
        try:
            yield
        finally:
            if swap:
                self._swap()

    def averaged_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with the averaged weights (under fsdp: this rank's shards;
        ``trainer.backend.unsharded(...)`` gathers them). Call it on every rank."""
        with self.applied():
            return {name: tensor.detach().clone() for name, tensor in self.trainer.module.state_dict().items()}

    # -- evaluation: the average swapped in per loader -------------------------------------
    def _begin_evaluation(self) -> None:
        if self.use_for_validation and self.updates > 0 and not self._swapped:
            self._swap()

    def _end_evaluation(self) -> None:
        if self._swapped:
            self._swap()

    def on_begin_val_epoch(self, global_step: int, key: str) -> None:
        self._begin_evaluation()

    def on_end_val_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        self._end_evaluation()

    def on_begin_test_epoch(self, global_step: int, key: str) -> None:
        self._begin_evaluation()

    def on_end_test_epoch(self, global_step: int, *outputs: Any, key: str) -> None:
        self._end_evaluation()

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.averaged is None:
            return {}
        if self._swapped:  # a checkpoint taken during evaluation keeps the average where it belongs
            raise RuntimeError(f"{type(self).__name__}: a checkpoint cannot be taken while the average is swapped in")
        return {"averaged": self.averaged.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        self._ready()[0].load_state_dict(state["averaged"])

    def load_evaluation_state(self, state: Optional[Dict[str, Any]]) -> None:
        """The average saved with the checkpoint being evaluated; none saved (an export, a run
        without averaging, a step before the first update): its weights are evaluated as they are."""
        averaged = self._ready()[0]
        if state:
            averaged.load_state_dict(state["averaged"])
        else:
            averaged.n_averaged.zero_()  # the next update starts the average afresh from the weights


def _on_local_shards(average: Callable[..., None], local_shards: Callable[[Any], Any]) -> Callable[..., None]:
    """``average`` (a ``multi_avg_fn``) applied to this rank's part of each sharded tensor
    (``TrainerBackend.local_shards``): an average is elementwise, and torch's foreach kernels
    refuse a group that mixes sharded parameters (DTensors) with whole buffers."""

    def on_local_shards(averaged: Sequence[torch.Tensor], current: Sequence[torch.Tensor], count: Any) -> None:
        average(local_shards(list(averaged)), local_shards(list(current)), count)

    return on_local_shards
