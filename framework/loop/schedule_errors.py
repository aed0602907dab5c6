"""A schedule that ran out of steps: say why (often an extended, resumed run) and what to do."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from framework.loop.view import TrainerView

_EXHAUSTED = "Tried to step"  # torch's OneCycleLR: "Tried to step 231 times. The specified number of total steps is 230"


def explain_exhausted_schedule(error: ValueError, trainer: "TrainerView") -> None:
    """Raise a ``ValueError`` that explains ``error`` when it is a schedule stepped past its
    ``total_steps`` (torch's ``OneCycleLR``); return otherwise (the caller re-raises ``error``).

    The usual cause: a finished run resumed with more ``epochs``. The schedule's state, its
    ``total_steps`` included, comes from the checkpoint, and ``OneCycleLR`` cannot be extended;
    the way on is a new run that loads the weights only. Without a resume, the module built
    the schedule for fewer steps than the run takes.

    Example:
        try:
            scheduler.step()
        except ValueError as error:
            explain_exhausted_schedule(error, trainer)
            raise
    """
    if not str(error).startswith(_EXHAUSTED):
        return
    bounded = [s for s in trainer.schedulers if isinstance(getattr(s, "total_steps", None), int)]
    exhausted = [s for s in bounded if getattr(s, "last_epoch", 0) > s.total_steps] or bounded
    scheduler = exhausted[0] if exhausted else None
    name = type(scheduler).__name__ if scheduler is not None else "a scheduler"
    total = getattr(scheduler, "total_steps", "?")
    args, step = trainer.args, trainer.global_steps_finished
    per_epoch = trainer.estimated_global_steps_per_epoch
    planned = f"{args.epochs} epochs x {per_epoch} steps = {args.epochs * per_epoch}" if per_epoch else f"{args.epochs} epochs"
    loaded_from = getattr(trainer.checkpointer, "loaded_from", None)
    if loaded_from and not trainer.checkpointer.restores_model_only():
        directory = _checkpoint_directory(trainer.checkpointer, loaded_from)
        message = (
            f"{name} ran out of steps after {step} optimizer steps: it was built for total_steps={total} by the run "
            f"this one resumed ({loaded_from}), and a resume restores the schedule as it was saved, while this run "
            f"plans {planned}. {name} cannot be extended. To train longer, start a new run from those weights, "
            f"with a schedule built afresh for the new epochs: --checkpointer.load_dir {directory} "
            "--checkpointer.reset_optimizers_schedulers true --trainer.output_dir NEW_DIR (optimizers, schedulers "
            f"and counters start over); or resume with the epochs the run was started with"
        )
    else:
        message = (
            f"{name} ran out of steps after {step} optimizer steps: get_optimizers_schedulers built it for "
            f"total_steps={total}, but this run plans {planned}; build the schedule from the arguments it "
            "receives: total_steps=estimated_global_steps_per_epoch * epochs"
        )
    raise ValueError(f"{message} (torch: {error})") from error


def _checkpoint_directory(checkpointer: object, loaded_from: str) -> str:
    """Where the resumed checkpoint lies, as the user would type it (a local path without ``file://``)."""
    save_dir = getattr(checkpointer, "save_dir", None)
    if getattr(checkpointer, "resumed_own_run", False) and save_dir:
        return str(save_dir)
    directory = loaded_from.rsplit("/", 1)[0] if "/" in loaded_from else "."
    return directory[len("file://") :] if directory.startswith("file://") else directory
