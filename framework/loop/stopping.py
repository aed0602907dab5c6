"""When training stops: epochs and ``max_steps``, ``max_time``, a signal, or a stop request,
agreed by every rank."""

import time
from typing import List, Optional

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.lifecycle.preemption import PreemptionHandler


class StopConditions:
    """The reasons to stop a run, and the agreement of the ranks on them.

    ``should_stop`` is a request (a callback's, or ``EarlyStopping``'s) honoured once
    ``min_epochs`` are done; ``time_is_up`` and ``preempted`` end training at the next step
    boundary. Every rank answers the same: at log points the flags ride on the loss
    all-reduce (:meth:`adopt`); between them the strategy agrees on a pending clock or signal.

    Args:
        args: ``epochs``, ``min_epochs``, ``max_steps``, ``max_time``, ``log_every_n_steps``.
        backend: agrees on the flags across ranks.
        preemption: the signal handler whose ``requested`` flag counts as a stop.

    Example:
        stopping = StopConditions(args=args, backend=backend, preemption=preemption)
        stopping.start_clock()
        if stopping.after_step(step, epochs_finished):
            ...  # leave the epoch
    """

    def __init__(self, *, args: TrainerArguments, backend: TrainerBackend, preemption: PreemptionHandler) -> None:
        self.args, self.backend, self.preemption = args, backend, preemption
        self.should_stop = False
        self.time_is_up = False
        self.preempted = False
        self._distributed = backend.world_size > 1
        self._start_time = time.monotonic()

    def start_clock(self) -> None:
        """``max_time`` counts from here (the start of ``train()``)."""
        self._start_time = time.monotonic()

    def after_step(self, step: int, epochs_finished: int) -> bool:
        """After each optimizer step: True when the epoch must end here (on every rank alike)."""
        args = self.args
        if args.max_steps is not None and step >= args.max_steps:
            return True
        if not self._distributed:
            self.time_is_up = self.time_is_up or (args.max_time is not None and self.clock_expired())
            self.preempted = self.preemption.requested
            return self.time_is_up or self.preempted or (self.should_stop and self.should_end(epochs_finished, step))
        if step % args.log_every_n_steps == 0:  # the flags rode on the log point's all-reduce
            return self.should_end(epochs_finished, step)
        pending = self.preemption.requested or self.clock_expired()
        if pending and self.backend.preemption_agreed(True, step):
            self.agree()  # once, at the agreed step: every rank learns every reason
            return True
        return False

    def clock_expired(self) -> bool:
        max_time = self.args.max_time
        return max_time is not None and time.monotonic() - self._start_time > max_time

    def flags(self) -> List[bool]:
        """This rank's stop request, expired clock and pending signal."""
        return [self.should_stop, self.time_is_up or self.clock_expired(), self.preemption.requested]

    def adopt(self, any_rank: List[bool]) -> None:
        """Take the flags every rank agreed on (in the order of :meth:`flags`)."""
        self.should_stop, self.time_is_up, self.preempted = (bool(flag) for flag in any_rank)

    def agree(self) -> None:
        """Every rank adopts any rank's stop request, expired clock and signal (one tiny all-reduce)."""
        self.adopt(self.backend.any_rank(self.flags()))

    def should_end(self, epochs_finished: int, steps_finished: int) -> bool:
        """True when training is over: complete, out of time, preempted, or asked to stop after ``min_epochs``."""
        if self.complete(epochs_finished, steps_finished) or self.time_is_up or self.preempted:
            return True
        return self.should_stop and epochs_finished >= self.args.min_epochs

    def complete(self, epochs_finished: int, steps_finished: Optional[int]) -> bool:
        """Every epoch, or ``max_steps``, done."""
        max_steps = self.args.max_steps
        return epochs_finished >= self.args.epochs or (
            max_steps is not None and steps_finished is not None and steps_finished >= max_steps
        )
