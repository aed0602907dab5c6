"""The sanity validation before training: a few batches of each validation loader, so that a
broken ``val_step`` fails before the first optimizer step rather than after an epoch.

As in Lightning, it is the whole validation loop, hooks included (``on_begin_val_epoch``,
``on_end_val_step``, ``on_end_val_epoch``), with ``trainer.sanity_checking`` true so that a hook
can tell. It changes nothing the training run sees: every random generator (python, numpy, torch,
CUDA) is restored afterwards, the training loader is not touched, and nothing the steps or hooks
log is recorded (the evaluator's ``record=False``; the recorder drops ``trainer.log_metrics``
calls meanwhile), so no logger, early stopping or "best" checkpoint sees it.
"""

from typing import Any, Callable, Protocol

from framework.data.rng import capture_rng_state, restore_rng_state

TURN_OFF_HINT = "set TrainerArguments.sanity_val_steps=0 (--trainer.sanity_val_steps 0) to skip this check"


def sanity_check_due(sanity_val_steps: int, fast_dev_run: bool, global_steps_finished: int) -> bool:
    """Whether :func:`run_sanity_check` runs: asked for, a fresh run (a resumed one validated
    before it was saved), and not ``fast_dev_run`` (which validates a batch anyway).

    Example:
        >>> sanity_check_due(2, False, 0), sanity_check_due(2, False, 10), sanity_check_due(0, False, 0)
        (True, False, False)
    """
    return sanity_val_steps > 0 and not fast_dev_run and global_steps_finished == 0


class SanityFlag(Protocol):
    """What holds the ``sanity_checking`` flag (the trainer's metric recorder)."""

    sanity_checking: bool


def run_sanity_check(evaluate: Callable[[], Any], sanity_val_steps: int, flag: SanityFlag) -> None:
    """Call ``evaluate`` (a non-recording validation of ``sanity_val_steps`` batches) with
    ``flag.sanity_checking`` true meanwhile and every random generator restored afterwards; an
    error it raises gains a note naming the check and how to turn it off.

    Example:
        >>> import torch
        >>> class Recorder:
        ...     sanity_checking = False
        >>> recorder, before = Recorder(), torch.get_rng_state()
        >>> run_sanity_check(lambda: print(recorder.sanity_checking, torch.rand(3).shape), 2, recorder)
        True torch.Size([3])
        >>> torch.equal(before, torch.get_rng_state()), recorder.sanity_checking
        (True, False)
    """
    state = capture_rng_state()
    flag.sanity_checking = True
    try:
        evaluate()
    except Exception as error:
        error.add_note(f"raised during the sanity validation of {sanity_val_steps} batch(es) before training; {TURN_OFF_HINT}")
        raise
    finally:
        flag.sanity_checking = False
        restore_rng_state(state)
