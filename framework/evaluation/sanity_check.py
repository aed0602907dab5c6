"""The sanity validation before training: a few batches of each validation loader, so that a
broken ``val_step`` fails before the first optimizer step rather than after an epoch.

It changes nothing the training run sees: every random generator (python, numpy, torch, CUDA)
is restored afterwards, the training loader is not touched, and nothing is recorded, logged or
given to the hooks that read metrics (the evaluator's ``record=False``).
"""

from typing import Any, Callable

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


def run_sanity_check(evaluate: Callable[[], Any], sanity_val_steps: int) -> None:
    """Call ``evaluate`` (a non-recording validation of ``sanity_val_steps`` batches) with every
    random generator restored afterwards; an error it raises gains a note naming the check and
    how to turn it off.

    Example:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> run_sanity_check(lambda: torch.rand(3), 2)
        >>> torch.equal(before, torch.get_rng_state())
        True
    """
    state = capture_rng_state()
    try:
        evaluate()
    except Exception as error:
        error.add_note(f"raised during the sanity validation of {sanity_val_steps} batch(es) before training; {TURN_OFF_HINT}")
        raise
    finally:
        restore_rng_state(state)
