"""Numeric precision plugins: how the forward runs and how gradients become an update.

Precision code never touches the process group; strategy code never touches the scaler.
"""

import contextlib
from typing import Any, ContextManager, Dict, Optional, Sequence, Type, TypeVar

import torch

from backends.checkpoint_io.stateful import refuse_renamed_state_methods
from backends.data.batch import map_tensors
from backends.options import BackendArguments, option

_NO_CONTEXT = contextlib.nullcontext()  # reusable: a forward in full precision enters nothing

P = TypeVar("P", bound="Precision")

_AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Precision:
    """Full fp32 precision: every method is the plain PyTorch call.

    Subclass it to change how the forward runs (:meth:`forward_context`), how the loss is
    back-propagated (:meth:`backward`) or how optimizers step (:meth:`step_optimizers`).

    Example:
        >>> precision = FullPrecision()
        >>> precision.setup(torch.device("cpu"), amp_dtype=None)
        >>> with precision.forward_context():
        ...     pass
    """

    name = "fp32"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_renamed_state_methods(cls, "docs/backends.md")

    @classmethod
    def from_arguments(cls: Type[P], args: Optional[BackendArguments] = None) -> P:
        """This precision built with the options it takes from a run's arguments (here: none).

        Example:
            >>> FullPrecision.from_arguments(None).options
            {}
        """
        return cls()

    @property
    def options(self) -> Dict[str, Any]:
        """The backend options this precision takes (``TrainerArguments`` names) and the values
        it was built with (see :func:`backends.options.check_backend_options`)."""
        return {}

    def setup(self, device: torch.device, amp_dtype: Optional[str] = None) -> None:
        """Called once the strategy knows the device. Options are constructor arguments:
        :class:`~backends.TrainerBackend` passes ``amp_dtype=None`` (the argument is kept so
        that precisions written for its earlier signature still work)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module as this precision trains it, before the strategy wraps it and before the
        optimizers are built (true bf16 casts it)."""
        return module

    def convert_input(self, batch: Any) -> Any:
        """A batch as the forward receives it (true bf16 casts its floating tensors); only called
        when a subclass overrides it."""
        return batch

    def forward_context(self) -> ContextManager:
        """The context that train, val and test forwards run in."""
        return _NO_CONTEXT

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (already divided by the accumulation length); ``args`` and
        ``kwargs`` go to ``Tensor.backward`` (``retain_graph=True``)."""
        loss.backward(*args, **kwargs)

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Bring gradients to their true scale before they are clipped or inspected."""

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        """Step every optimizer; return False when the update was skipped (so schedulers wait)."""
        for optimizer in optimizers:
            optimizer.step(closure) if closure is not None else optimizer.step()
        return True

    @property
    def skips_nonfinite_steps(self) -> bool:
        """True when a step whose gradients are not finite is skipped (a GradScaler's job)."""
        return False

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype forwards compute in when it is not fp32 (a sharded strategy gathers parameters in it)."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """Precision state that belongs in a checkpoint."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class FullPrecision(Precision):
    """fp32 everywhere (the ``sp`` and ``ddp`` backends).

    Example:
        >>> FullPrecision().name
        'fp32'
    """


class MixedPrecision(Precision):
    """``torch.autocast`` around every forward, plus a ``GradScaler`` when the dtype is fp16.

    On CUDA the default is fp16 with dynamic loss scaling; ``"bfloat16"`` runs without a
    scaler. On CPU only bf16 autocast exists: asking for fp16 there is an error. Gradients
    are unscaled before clipping, and a step the scaler skips (inf/nan gradients) is
    reported to the trainer so learning-rate schedulers do not advance for it.

    Args:
        dtype: ``"float16"``, ``"bfloat16"`` or None (from ``TrainerArguments.amp_dtype``;
            when that is None too: fp16 on CUDA, bf16 on CPU).
        use_grad_scaler: None: a ``GradScaler`` exactly when the dtype is fp16; True/False
            force it on or off (e.g. dynamic loss scaling for bf16 on CPU).
        default_dtype: used when neither ``dtype`` nor ``amp_dtype`` is set (``fsdp-amp``:
            ``"bfloat16"``, also on CUDA); None: fp16 on CUDA, bf16 on CPU.

    Example:
        >>> precision = MixedPrecision("bfloat16")
        >>> precision.setup(torch.device("cpu"), amp_dtype=None)
        >>> with precision.forward_context():
        ...     y = torch.nn.Linear(4, 4)(torch.ones(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    name = "amp"

    def __init__(
        self, dtype: Optional[str] = None, use_grad_scaler: Optional[bool] = None, default_dtype: Optional[str] = None
    ) -> None:
        for name, value in (("dtype", dtype), ("default_dtype", default_dtype)):
            if value is not None and value not in _AMP_DTYPES:
                raise ValueError(f"MixedPrecision {name}={value!r} is not supported; allowed: None, {sorted(_AMP_DTYPES)}")
        self.requested_dtype = dtype
        self.default_dtype = default_dtype
        self.use_grad_scaler = use_grad_scaler
        self.device_type = "cpu"
        self.dtype = torch.bfloat16
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._pending_scaler_state: Optional[Dict[str, Any]] = None

    @classmethod
    def from_arguments(cls, args: Optional[BackendArguments] = None) -> "MixedPrecision":
        """Mixed precision in ``TrainerArguments.amp_dtype`` (None: fp16 on CUDA, bf16 on CPU).

        Example:
            >>> from types import SimpleNamespace
            >>> MixedPrecision.from_arguments(SimpleNamespace(amp_dtype="bfloat16")).options
            {'amp_dtype': 'bfloat16'}
        """
        return cls(dtype=option(args, "amp_dtype"))

    @property
    def options(self) -> Dict[str, Any]:
        return {"amp_dtype": self.requested_dtype}

    def setup(self, device: torch.device, amp_dtype: Optional[str] = None) -> None:
        name = self.requested_dtype or amp_dtype or self.default_dtype or ("float16" if device.type == "cuda" else "bfloat16")
        if name not in _AMP_DTYPES:
            raise ValueError(f"amp_dtype={name!r} is not supported; allowed: {sorted(_AMP_DTYPES)}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"mixed precision runs on 'cuda' or 'cpu' devices, got {device.type!r}")
        if device.type == "cpu" and name == "float16":
            raise ValueError(
                "amp_dtype='float16' needs a CUDA device; on CPU mixed precision is bf16 autocast: "
                "use amp_dtype='bfloat16' (or leave it unset)"
            )
        if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"amp_dtype='bfloat16' is not supported by {torch.cuda.get_device_name(device)}; use amp_dtype='float16'"
            )
        self.device_type = device.type
        self.dtype = _AMP_DTYPES[name]
        use_scaler = self.dtype == torch.float16 if self.use_grad_scaler is None else self.use_grad_scaler
        self.scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        if self.scaler is not None and self._pending_scaler_state:
            self.scaler.load_state_dict(self._pending_scaler_state)
        self._pending_scaler_state = None

    def forward_context(self) -> ContextManager:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.scaler is None:
            loss.backward(*args, **kwargs)
        else:
            self.scaler.scale(loss).backward(*args, **kwargs)

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        if self.scaler is None:
            return super().step_optimizers(optimizers, closure)
        if closure is not None:
            raise ValueError("optimizers that need a closure (e.g. LBFGS) cannot run with an fp16 GradScaler")
        # GradScaler.step already waits for its inf check; comparing the scale around
        # update() tells whether it skipped, at the cost of one more tiny read.
        scale_before = self.scaler.get_scale()
        for optimizer in optimizers:
            # GradScaler.step refuses an optimizer none of whose parameters has a gradient
            # (e.g. the idle one of two alternating optimizers); stepping it is a no-op anyway.
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before

    @property
    def skips_nonfinite_steps(self) -> bool:
        return self.scaler is not None

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return self.dtype

    def state_dict(self) -> Dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        scaler_state = state.get("scaler")
        if not scaler_state:
            return
        if self.scaler is None:
            self._pending_scaler_state = scaler_state
        else:
            self.scaler.load_state_dict(scaler_state)


class TrueBF16(Precision):
    """Parameters, gradients and optimizer state in bfloat16, with no fp32 master copy.

    The module's floating parameters and buffers are cast to bfloat16 before the strategy wraps
    it (so ``ddp`` reduces bf16 gradients and ``fsdp`` shards bf16 parameters); complex and
    integer ones keep their dtype (a rotary table ``freqs_cis`` in complex64 stays complex:
    ``Module.to(torch.bfloat16)`` would keep only its real part). The optimizers are built on the bf16
    parameters (Adam's moments are bf16 too), and every floating tensor of a batch is cast to
    bfloat16 (integer labels and token ids stay as they are). Checkpoints hold bf16 weights.
    Half the memory of fp32 for the weights, gradients and optimizer state, and half the
    communication; the price is that updates smaller than bf16's resolution (about 3
    significant digits) are lost, which ``*-amp``'s fp32 master weights keep. See
    ``docs/backends.md`` for when to pick which.

    Example:
        >>> precision = TrueBF16()
        >>> precision.setup(torch.device("cpu"), amp_dtype=None)
        >>> precision.convert_module(torch.nn.Linear(2, 2)).weight.dtype
        torch.bfloat16
        >>> rotary = torch.nn.Module()
        >>> rotary.register_buffer("freqs_cis", torch.polar(torch.ones(2), torch.zeros(2)))
        >>> precision.convert_module(rotary).freqs_cis.dtype
        torch.complex64
        >>> precision.convert_input((torch.ones(1), torch.tensor([3])))
        (tensor([1.], dtype=torch.bfloat16), tensor([3]))
    """

    name = "bf16-true"

    @classmethod
    def from_arguments(cls, args: Optional[BackendArguments] = None) -> "TrueBF16":
        """True bf16; ``TrainerArguments.amp_dtype`` may only be None or ``"bfloat16"``.

        Raises:
            ValueError: another ``amp_dtype``.

        Example:
            >>> TrueBF16.from_arguments(None).options
            {'amp_dtype': 'bfloat16'}
        """
        _check_bf16_dtype(option(args, "amp_dtype"))
        return cls()

    @property
    def options(self) -> Dict[str, Any]:
        return {"amp_dtype": "bfloat16"}

    def setup(self, device: torch.device, amp_dtype: Optional[str] = None) -> None:
        _check_bf16_dtype(amp_dtype)
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"true bf16 needs a GPU with bfloat16 support; {torch.cuda.get_device_name(device)} has none")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module._apply(_to_bfloat16)  # what Module.to does, for floating tensors only

    def convert_input(self, batch: Any) -> Any:
        return map_tensors(batch, _to_bfloat16)


def _check_bf16_dtype(amp_dtype: Optional[str]) -> None:
    if amp_dtype not in (None, "bfloat16"):
        raise ValueError(f"amp_dtype={amp_dtype!r} does not apply to true bf16 precision; allowed: None, 'bfloat16'")


def _to_bfloat16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16) if torch.is_floating_point(tensor) else tensor
