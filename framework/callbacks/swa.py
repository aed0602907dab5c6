"""SWA: stochastic weight averaging, as Lightning's ``StochasticWeightAveraging``."""

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from framework.callbacks.weight_averaging import WeightAveraging
from framework.loop.stage import Stage

logger = logging.getLogger(__name__)

_BATCH_NORMS = torch.nn.modules.batchnorm._BatchNorm


class SWA(WeightAveraging):
    """Stochastic weight averaging: from epoch ``swa_epoch_start`` on, the learning rate moves
    to ``swa_lrs`` and the weights at the end of every epoch enter an equal-weight average
    (``AveragedModel``'s running mean). When training ends the average replaces the weights
    and batch-norm statistics are recomputed over the training data (``update_bn``'s method,
    through the trainer's own forward), so the final checkpoint holds the SWA model.

    The learning rate is annealed from each group's rate at ``swa_epoch_start`` to
    ``swa_lrs`` over ``annealing_epochs`` epochs (``"cos"`` or ``"linear"``, as ``SWALR``) and
    held there; the trainer's schedulers keep stepping, but the callback sets the rate after
    each optimizer step. The average, the starting rates and the epoch are saved in
    checkpoints, so a resumed run ends with the same weights.

    Args:
        swa_lrs: the SWA learning rate, one for every parameter group or a list with one per
            group of every optimizer.
        swa_epoch_start: the first SWA epoch: an epoch index (>= 0) or a fraction of
            ``epochs`` in (0, 1).
        annealing_epochs: epochs to move the rate to ``swa_lrs`` (>= 1).
        annealing_strategy: ``"cos"`` or ``"linear"``.
        use_for_validation: evaluate the average in validation and test once it exists.

    Example:
        >>> from framework.callbacks import SWA
        >>> swa = SWA(swa_lrs=0.01, swa_epoch_start=0.75)
        >>> # Trainer(module, args, callbacks=[swa]).train()  -> the module ends with the SWA weights
    """

    def __init__(
        self,
        swa_lrs: Union[float, Sequence[float]],
        swa_epoch_start: Union[int, float] = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        use_for_validation: bool = False,
    ) -> None:
        rates = [swa_lrs] if isinstance(swa_lrs, (int, float)) else list(swa_lrs)
        if not rates or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 for r in rates):
            raise ValueError(f"SWA swa_lrs={swa_lrs!r} is invalid; allowed: a number > 0 or a list of them")
        start_ok = (isinstance(swa_epoch_start, int) and swa_epoch_start >= 0) or (
            isinstance(swa_epoch_start, float) and 0 < swa_epoch_start < 1
        )
        if isinstance(swa_epoch_start, bool) or not start_ok:
            raise ValueError(
                f"SWA swa_epoch_start={swa_epoch_start!r} is invalid; allowed: an epoch index >= 0 or a fraction in (0, 1)"
            )
        if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) or annealing_epochs < 1:
            raise ValueError(f"SWA annealing_epochs={annealing_epochs!r} is invalid; allowed: an integer >= 1")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(f"SWA annealing_strategy={annealing_strategy!r} is invalid; allowed: 'cos', 'linear'")
        super().__init__(None, use_buffers=False, use_for_validation=use_for_validation)
        self.swa_lrs = [float(rate) for rate in rates]
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.start_lrs: Optional[List[float]] = None
        self._epoch = 0

    @property
    def first_epoch(self) -> int:
        """The index of the first SWA epoch."""
        if isinstance(self.swa_epoch_start, float):
            return int(self.swa_epoch_start * self.trainer.args.epochs)
        return self.swa_epoch_start

    def _groups(self) -> List[Dict[str, Any]]:
        return [group for optimizer in self.trainer.optimizers for group in optimizer.param_groups]

    def _set_learning_rates(self) -> None:
        groups = self._groups()
        if self.start_lrs is None:
            if len(self.swa_lrs) not in (1, len(groups)):
                raise ValueError(
                    f"SWA swa_lrs={self.swa_lrs} has {len(self.swa_lrs)} rates for {len(groups)} parameter groups; "
                    "allowed: one rate, or one per group"
                )
            self.start_lrs = [float(group["lr"]) for group in groups]
            logger.info("SWA: averaging from epoch %d on, learning rate annealed to %s", self._epoch, self.swa_lrs)
        progress = min(1.0, (self._epoch - self.first_epoch + 1) / self.annealing_epochs)
        alpha = (1 - math.cos(math.pi * progress)) / 2 if self.annealing_strategy == "cos" else progress
        targets = self.swa_lrs * len(groups) if len(self.swa_lrs) == 1 else self.swa_lrs
        for group, start, target in zip(groups, self.start_lrs, targets):
            group["lr"] = target * alpha + start * (1 - alpha)

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self._epoch = epoch
        if epoch >= self.first_epoch:
            self._set_learning_rates()

    def on_end_optimizer_step(self, global_step: int) -> None:
        if self._epoch >= self.first_epoch:
            self._set_learning_rates()  # after the trainer's schedulers stepped

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        if self._epoch >= self.first_epoch:
            self.update()

    def on_end_train(self, global_step: int) -> None:
        if self.updates == 0 or self._swapped:
            return
        with torch.no_grad():
            for live, averaged in self._pairs():
                live.detach().copy_(averaged)
        self._recompute_batch_norm(global_step)
        logger.info("SWA: the module holds the average of %d epochs", self.updates)

    def _recompute_batch_norm(self, global_step: int) -> None:
        """``torch.optim.swa_utils.update_bn`` over the training data, through the trainer's forward."""
        norms = [m for m in self.trainer.module.modules() if isinstance(m, _BATCH_NORMS) and m.track_running_stats]
        if not norms:
            return
        trainer = self.trainer
        momenta = {}
        for norm in norms:
            norm.reset_running_stats()
            momenta[norm] = norm.momentum
            norm.momentum = None  # a cumulative mean over the batches
        sampler = trainer.backend.sampler_factory(shuffle=False, seed=trainer.args.seed)
        loader = trainer.backend.prepare_loader(trainer.module.get_train_dataloader(sampler, trainer.train_step_batch_size))
        wrapped = trainer.wrapped_module if trainer.wrapped_module is not None else trainer.module
        was_training = trainer.module.training
        trainer.module.train()
        try:
            with torch.no_grad(), trainer.backend.inference(wrapped):  # fsdp: the units are resharded after
                for batch in loader:
                    batch = trainer.backend.move_to_device(batch)
                    trainer.backend.forward(wrapped, Stage.TRAIN, global_step, batch, trainer.device)
        finally:
            for norm, momentum in momenta.items():
                norm.momentum = momentum
            trainer.module.train(was_training)

    def drives_hyperparameters(self) -> Tuple[str, ...]:
        """``("lr",)`` once SWA has begun: its annealed rate, not the configured one, is used on resume."""
        return ("lr",) if self.start_lrs is not None else ()

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        return {**state, "start_lrs": self.start_lrs} if state else state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state:
            self.start_lrs = state["start_lrs"]
