"""Where a run is: counters, the position inside the epoch, and mapping it onto another world size."""

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

from framework.data.rng import restore_rng_state

logger = logging.getLogger("framework")


@dataclass
class TrainingProgress:
    """The counters a run advances and a checkpoint restores.

    Attributes:
        epochs_finished: epochs completed.
        global_steps_finished: optimizer steps completed (manual optimization: train batches).
        batches_finished_in_epoch: micro-batches of the current epoch this rank has consumed.
        last_validated_step: the step the latest validation ran at (None before any), so a
            resumed run never validates the same step twice.
        epoch_resumed: True while the current epoch is one a checkpoint resumed mid-way.

    Example:
        >>> progress = TrainingProgress()
        >>> progress.finish_step(micro_batches=2)
        >>> progress.global_steps_finished, progress.batches_finished_in_epoch
        (1, 2)
    """

    epochs_finished: int = 0
    global_steps_finished: int = 0
    batches_finished_in_epoch: int = 0
    last_validated_step: Optional[int] = None
    epoch_resumed: bool = False

    def finish_step(self, micro_batches: int) -> None:
        """One optimizer step over ``micro_batches`` micro-batches is done."""
        self.global_steps_finished += 1
        self.batches_finished_in_epoch += micro_batches

    def finish_epoch(self) -> None:
        self.epochs_finished += 1
        self.batches_finished_in_epoch = 0
        self.epoch_resumed = False

    def state_dict(self, world_size: int, micro_batch_size: int) -> Dict[str, Any]:
        return {
            "epochs_finished": self.epochs_finished,
            "global_steps_finished": self.global_steps_finished,
            "batches_finished_in_epoch": self.batches_finished_in_epoch,
            "last_validated_step": self.last_validated_step,
            "micro_batch_size": micro_batch_size,
            "world_size": world_size,
        }

    def load_state_dict(self, state: Dict[str, Any], world_size: int, micro_batch_size: int, accumulation: int) -> None:
        """Restore counters; a position saved with another world size or micro-batch is remapped."""
        self.epochs_finished = int(state["epochs_finished"])
        self.global_steps_finished = int(state["global_steps_finished"])
        self.last_validated_step = state.get("last_validated_step")
        self.batches_finished_in_epoch = resume_position(
            int(state["batches_finished_in_epoch"]),
            saved_world_size=int(state.get("world_size", world_size)),
            saved_micro_batch=int(state.get("micro_batch_size", micro_batch_size)),
            world_size=world_size,
            micro_batch=micro_batch_size,
            accumulation=accumulation,
        )
        self.epoch_resumed = self.batches_finished_in_epoch > 0


def resume_position(
    batches: int, saved_world_size: int, saved_micro_batch: int, world_size: int, micro_batch: int, accumulation: int
) -> int:
    """Micro-batches of the epoch this rank has finished, for a checkpoint taken at ``batches``.

    A checkpoint taken with another world size or micro-batch size is mapped through the
    number of samples the whole job had consumed in the epoch, rounded down to an optimizer step.

    Example:
        >>> resume_position(6, saved_world_size=1, saved_micro_batch=8, world_size=2, micro_batch=8, accumulation=1)
        3
    """
    if not batches or (saved_world_size, saved_micro_batch) == (world_size, micro_batch):
        return batches
    samples = batches * saved_micro_batch * saved_world_size
    if samples % (micro_batch * world_size * accumulation):
        logger.warning(
            "checkpoint taken after %d samples of the epoch (%d ranks x %d per micro-batch); resuming with %d ranks x %d "
            "x %d accumulated micro-batches does not land on an optimizer step: it resumes from the step before "
            "(those samples are seen twice)",
            samples,
            saved_world_size,
            saved_micro_batch,
            world_size,
            micro_batch,
            accumulation,
        )
    resumed = samples // (micro_batch * world_size)
    return resumed - resumed % accumulation


def accumulation_cycles(micro_batches: Optional[int], accumulation: int, start: int = 0) -> Iterator[int]:
    """Micro-batches per optimizer step for the rest of an epoch, planned up front.

    An epoch of ``micro_batches`` has full cycles of ``accumulation`` and, when it does not
    divide, one shorter last cycle. ``start`` (a cycle boundary) skips what a resumed run
    already did. ``micro_batches=None`` (a stream without a length) repeats full cycles
    until the stream ends.

    Example:
        >>> list(accumulation_cycles(7, accumulation=3)), list(accumulation_cycles(7, 3, start=3))
        ([3, 3, 1], [3, 1])
    """
    if micro_batches is None:
        return itertools.repeat(accumulation)
    full, rest = divmod(max(micro_batches - start, 0), accumulation)
    return itertools.chain(itertools.repeat(accumulation, full), [rest] if rest else [])


class PendingRng:
    """RNG states restored from a checkpoint, applied where the saved run drew next.

    Creating a DataLoader iterator draws a seed from the global RNG. A run saved at an
    epoch boundary had not drawn it yet (restore before ``iter``); a run saved mid-epoch had
    (restore after ``iter``). :meth:`apply` restores once and forgets.

    Example:
        >>> from framework.data.rng import capture_rng_state
        >>> pending = PendingRng()
        >>> pending.set(capture_rng_state()); pending.apply(); pending.apply()
    """

    def __init__(self) -> None:
        self._state: Optional[Dict[str, Any]] = None

    def set(self, state: Optional[Dict[str, Any]]) -> None:
        self._state = state

    def apply(self) -> None:
        if self._state is not None:
            restore_rng_state(self._state)
            self._state = None
