"""Building the optimizers and schedulers a module asks for."""

from typing import Any, List, Optional, Tuple

import torch

from framework.checks import check_optimizers_schedulers


def build_optimizers_schedulers(
    module: Any, estimated_global_steps_per_epoch: Optional[int], epochs: int
) -> Tuple[List[torch.optim.Optimizer], List[Any]]:
    """``module.get_optimizers_schedulers(...)`` as two lists.

    With a train loader of unknown length (a stream), ``estimated_global_steps_per_epoch`` is
    None; a schedule that computes with it fails in user code with a bare ``TypeError``, which
    is re-raised here with what to set instead.

    Raises:
        TypeError: the module's method failed on ``estimated_global_steps_per_epoch=None``.
        TypeError, ValueError: not ``([optimizers], [schedulers])`` (see :func:`check_optimizers_schedulers`).
    """
    try:
        returned = module.get_optimizers_schedulers(estimated_global_steps_per_epoch, epochs)
    except TypeError as error:
        if estimated_global_steps_per_epoch is not None:
            raise
        raise TypeError(
            f"{type(module).__name__}.get_optimizers_schedulers failed with estimated_global_steps_per_epoch=None "
            f"({error}): the train loader has no length (a stream), so the steps per epoch are unknown. Set "
            "TrainerArguments.max_train_steps_per_epoch to an int (the steps per epoch; --trainer.max_train_steps_per_epoch N), "
            "give the dataset a __len__, or build a schedule that does not need the epoch length"
        ) from error
    return check_optimizers_schedulers(returned)
