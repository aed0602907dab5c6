"""Training-loss bookkeeping kept out of the loop: device-side sums, read back only when logged."""

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

_NO_STEP = 2**62


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite; raised at the log point that read it.

    Attributes:
        step: ``global_step`` (optimizer steps finished) when the first non-finite loss was computed.
    """

    def __init__(self, step: int, value: float) -> None:
        super().__init__(
            f"the training loss became {value} at global_step={step} (the first non-finite loss); "
            "training stopped without saving these weights. Lower the learning rate, clip gradients "
            "(clip_grads=True) or resume from an earlier checkpoint; set stop_on_nonfinite_loss=False to train on"
        )
        self.step = step


class LossTracker:
    """Sums each micro-batch's training loss on the device; nothing is read back per step.

    ``add`` keeps the detached loss; the kept losses are folded into a running sum with one
    device op when read (at log points and epoch ends) or every 1024 micro-batches. Which
    optimizer step's loss was first not finite is searched for only where that can be the
    case: a finite mean read back (:meth:`after_read`) clears every loss it covers, so a
    healthy run never searches (an unread stretch is searched every 8192 micro-batches, on
    the device); a diverged run is still reported by step without a host sync per step.
    Sums are float64 (float32 on MPS), in which adding float32 losses is exact in practice:
    the logged means do not depend on where folds happened, so a run resumed from a
    checkpoint logs bitwise the same values.

    Args:
        device: where the sums live.

    Example:
        >>> tracker = LossTracker(torch.device("cpu"))
        >>> tracker.start_epoch()
        >>> for step, loss in enumerate([1.0, 3.0]):
        ...     tracker.add(torch.tensor(loss), step)
        >>> float(tracker.interval_mean()), float(tracker.epoch_mean())
        (2.0, 2.0)
    """

    _FOLD_EVERY = 1024
    _SEARCH_EVERY = 8192

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._dtype = torch.float32 if device.type == "mps" else torch.float64
        self._unsummed: List[torch.Tensor] = []
        self._unsummed_steps: List[int] = []
        self._epoch_sum = torch.zeros((), dtype=self._dtype, device=device)
        self._epoch_count = 0
        self._logged_sum = self._epoch_sum.clone()
        self._logged_count = 0
        self._first_bad_step = torch.full((), _NO_STEP, dtype=torch.long, device=device)
        self._unchecked: List[Tuple[torch.Tensor, List[int]]] = []  # folded losses no finite read has covered yet

    def start_epoch(self) -> None:
        """Forget the previous epoch's sums."""
        self._search_unchecked()
        self._unsummed = []
        self._unsummed_steps = []
        self._epoch_sum = torch.zeros((), dtype=self._dtype, device=self.device)
        self._epoch_count = 0
        self._logged_sum, self._logged_count = self._epoch_sum.clone(), 0

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Keep one micro-batch's loss (taken during optimizer step ``step``, counted from 0)."""
        self._unsummed.append(loss.detach())
        self._unsummed_steps.append(step)
        self._epoch_count += 1
        if len(self._unsummed) >= self._FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if not self._unsummed:
            return
        try:
            losses = torch.stack(self._unsummed).to(self._dtype)  # 0-d losses of one dtype: one op
        except RuntimeError:  # mixed shapes or dtypes
            losses = torch.stack([loss.to(self._dtype).reshape(()) for loss in self._unsummed])
        if losses.dim() != 1:
            losses = losses.reshape(len(self._unsummed), -1).mean(1)
        self._epoch_sum += losses.sum()
        self._unchecked.append((losses, self._unsummed_steps))
        self._unsummed = []
        self._unsummed_steps = []
        if sum(len(steps) for _, steps in self._unchecked) >= self._SEARCH_EVERY:
            self._search_unchecked()

    def _first_unchecked_bad_step(self) -> torch.Tensor:
        """The first non-finite loss's step, over what is known and the unchecked losses (device ops)."""
        if not self._unchecked:
            return self._first_bad_step
        losses = torch.cat([folded for folded, _ in self._unchecked])
        steps = torch.tensor([step for _, folded_steps in self._unchecked for step in folded_steps], device=self.device)
        return torch.minimum(self._first_bad_step, torch.where(torch.isfinite(losses), _NO_STEP, steps).min())

    def _search_unchecked(self) -> None:
        self._first_bad_step = self._first_unchecked_bad_step()
        self._unchecked = []

    def after_read(self, value: float) -> None:
        """The mean just read back (:meth:`interval_mean` at a log point, :meth:`epoch_mean`,
        over every rank) was ``value``: finite, it proves every loss it covers finite; else
        the losses it covers are searched for the first non-finite one now."""
        if math.isfinite(value):
            self._unchecked = []
        else:
            self._search_unchecked()

    @property
    def has_unlogged(self) -> bool:
        """True when losses were added since the last :meth:`mark_logged`."""
        return self._epoch_count > self._logged_count

    def interval_mean(self) -> torch.Tensor:
        """Mean loss since the last :meth:`mark_logged` (a device tensor)."""
        self._fold()
        return (self._epoch_sum - self._logged_sum) / max(self._epoch_count - self._logged_count, 1)

    def mark_logged(self) -> None:
        """The interval so far has been written."""
        self._logged_sum, self._logged_count = self._epoch_sum.clone(), self._epoch_count

    def epoch_mean(self) -> Optional[torch.Tensor]:
        """Mean loss of the epoch so far, or None before the first micro-batch."""
        self._fold()
        return self._epoch_sum / self._epoch_count if self._epoch_count else None

    def first_nonfinite_step(self) -> Optional[int]:
        """The step whose loss was first NaN/inf, or None (reads the device: call when a read is due)."""
        self._fold()
        self._search_unchecked()
        step = int(self._first_bad_step)
        return None if step == _NO_STEP else step

    def state_dict(self) -> Dict[str, Any]:
        """Sums, counts and the losses not folded yet (per rank), so a mid-epoch resume logs
        the same means to the last bit: saving does not change where sums are folded."""
        return {
            "running_loss": self._epoch_sum.detach().cpu(),
            "running_count": self._epoch_count,
            "logged_loss": self._logged_sum.detach().cpu(),
            "logged_count": self._logged_count,
            "unsummed_losses": [loss.cpu() for loss in self._unsummed],
            "unsummed_steps": list(self._unsummed_steps),
            "first_nonfinite_step": int(self._first_unchecked_bad_step()),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.start_epoch()
        self._epoch_sum = state["running_loss"].to(self.device, self._dtype)
        self._epoch_count = int(state["running_count"])
        self._logged_sum = state["logged_loss"].to(self.device, self._dtype)
        self._logged_count = int(state["logged_count"])
        self._unsummed = [loss.to(self.device) for loss in state.get("unsummed_losses", [])]
        self._unsummed_steps = [int(step) for step in state.get("unsummed_steps", [])]
        self._first_bad_step.fill_(int(state.get("first_nonfinite_step", _NO_STEP)))
