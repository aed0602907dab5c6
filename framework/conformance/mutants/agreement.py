"""Mutants of the ranks' agreements that only show when ranks differ in what happens to them:
different stop reasons per rank, and a rank zero whose checkpoint write is slow (the ``reasons``
and ``slow_io`` scenarios of ``resume_signal``). Every other cell passes on them: one reason on
one rank, or writes fast enough that the next collective hides a missing agreement."""

from typing import List, Optional, Sequence

import torch

from backends import DDP, FullPrecision
from framework.conformance.mutants.library import backend, register_mutant


class FirstReasonOnly(DDP):
    """The ranks agree on one stop reason, the first (in the flags' order) that any rank has: a rank's other reasons are lost."""

    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        if not self.distributed:
            return super().any_rank(flags)
        first = next((index for index, flag in enumerate(flags) if flag), len(flags))
        agreed = int(self.all_reduce(torch.tensor(float(first), device=self.device), "min").item())
        return [index == agreed for index in range(len(flags))]  # fault: one reason survives, not each that any rank has


class LeavesSaveEarly(DDP):
    """A rank whose part of a save succeeded leaves it at once: ``raise_if_any_failed`` raises only its own error, no gather."""

    def raise_if_any_failed(self, error: Optional[BaseException], what: str) -> None:
        if error is not None:  # fault: no all-gather, so no rank waits for rank zero's write (nor learns of its failure)
            raise error


def _register(name: str, strategy: type, kills: tuple, kind: str) -> None:
    register_mutant(name, backend(strategy, FullPrecision), (strategy.__doc__ or "").strip().splitlines()[0], kills, kind)


_register("mutant-ddp-first-reason-only", FirstReasonOnly, (("resume_signal", "mlp", 2),), "collectives")
_register("mutant-ddp-leaves-save-early", LeavesSaveEarly, (("resume_signal", "mlp", 2),), "state")
