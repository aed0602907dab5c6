"""TrainerBackend: the one object the Trainer talks to, a strategy composed with a precision."""

import logging
from typing import Any, Callable, ClassVar, ContextManager, Dict, List, Optional, Sequence, Sized, Tuple, Type

import torch

from backends.checkpoint_io.base import CheckpointIO
from backends.checkpoint_io.stateful import refuse_renamed_state_methods
from backends.data.batch import move_to_device
from backends.environments.detection import ClusterEnvironment
from backends.options import BackendArguments, check_backend_options
from backends.precision.precisions import FullPrecision, Precision
from backends.strategies.strategy import SingleProcess, Strategy

logger = logging.getLogger(__name__)


class TrainerBackend:
    """Decides where and how each step runs: ``strategy`` (devices, processes, gradient
    sync) times ``precision`` (autocast, loss scaling).

    The built-in backends are compositions: ``sp`` is ``TrainerBackend(SingleProcess(),
    FullPrecision())`` and ``ddp-amp`` is ``TrainerBackend(DDP(), MixedPrecision())``. A
    plugin subclasses this class (or a strategy or precision) and overrides what it needs;
    see ``docs/backends.md``. Options (``use_gpu``, ``find_unused_parameters``, ``amp_dtype``...)
    are given to the strategy's and the precision's constructors; :attr:`options` reports them.

    The trainer calls only this object: each method delegates to the strategy or the
    precision in one call (the per-step ones included), so a plugin may override any of them.

    Args:
        strategy: where steps run (default: :class:`SingleProcess`).
        precision: how numbers are represented (default: :class:`FullPrecision`).

    Example:
        >>> from backends import TrainerBackend, SingleProcess, MixedPrecision
        >>> backend = TrainerBackend(SingleProcess(use_gpu=False), MixedPrecision("bfloat16"))
        >>> backend.setup()
        >>> backend.device, backend.options["amp_dtype"]
        (device(type='cpu'), 'bfloat16')
    """

    unsupported_features: ClassVar[Dict[str, str]] = {}
    """Conformance checks this backend declares it does not support, by check name (``"manual"``,
    ``"resume"``...) with the reason; ``python -m framework.conformance`` reports them as declared
    refusals instead of running them. The backend must then refuse the feature before step 1."""
    conformance_reference: ClassVar[Optional[str]] = None
    """The registered backend the conformance kit compares this one with (None: the kit chooses:
    the built-in single-process backend of the closest precision class, ``sp-scaled-amp`` for a
    precision with a GradScaler). A new precision that no built-in computes as names the closest
    one (``"sp"``) and declares :attr:`conformance_compute_dtype`. See docs/backends.md,
    "Tolerances and results"."""
    conformance_compute_dtype: ClassVar[Optional[str]] = None
    """The dtype this backend's forwards compute in (``"float16"``), declared where it differs from
    its conformance reference's: the kit then checks that ``train_step`` computes in it and compares
    within its lower-precision tolerance on every world size (1 rank included) instead of bitwise."""
    resume_tolerance: float = 0.0
    """Largest parameter difference between a resumed run and an uninterrupted one that the
    conformance kit accepts (0.0: bitwise, what the built-in backends promise)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_renamed_state_methods(cls, "docs/backends.md")

    def __init__(self, strategy: Optional[Strategy] = None, precision: Optional[Precision] = None) -> None:
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a backends.Strategy (e.g. SingleProcess(), DDP()), got {type(strategy).__name__}")
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(
                f"precision must be a backends.Precision (e.g. FullPrecision(), MixedPrecision()), got {type(precision).__name__}"
            )
        self.strategy = strategy if strategy is not None else SingleProcess()
        self.precision = precision if precision is not None else FullPrecision()
        self._converts_input = type(self.precision).convert_input is not Precision.convert_input

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={type(self.strategy).__name__}, precision={type(self.precision).__name__})"

    # -- identity -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_main_process(self) -> bool:
        return self.strategy.is_main_process

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this rank reads (see :attr:`Strategy.data_parallel_rank`)."""
        return self.strategy.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into; the global batch is divided over them."""
        return self.strategy.data_parallel_size

    def data_parallel_representatives(self) -> List[int]:
        """One global rank per data-parallel rank, in order (the one that writes that share's outputs)."""
        return self.strategy.data_parallel_representatives()

    @property
    def options(self) -> Dict[str, Any]:
        """The backend options the strategy and the precision were built with, by their
        ``TrainerArguments`` names (see :func:`backends.options.check_backend_options`)."""
        return {**self.strategy.options, **self.precision.options}

    def check_options(self, args: Optional[BackendArguments]) -> None:
        """Refuse run arguments this instance would not use: an option set to a non-default
        value that the instance does not take, or was built with another value of (the
        instance's own options are used). ``Trainer(trainer_backend=...)`` calls it.

        Raises:
            ValueError: naming the option and where to pass it instead.

        Example:
            >>> from types import SimpleNamespace
            >>> TrainerBackend(SingleProcess(compile=True)).check_options(SimpleNamespace(compile=True))
        """
        check_backend_options(self, args, "instance")

    @property
    def multi_process(self) -> bool:
        """True when the strategy runs one process per device (launched by torchrun, srun...)."""
        return self.strategy.multi_process

    @property
    def strategy_name(self) -> str:
        """The strategy's name (``"single-process"``, ``"ddp"``, ``"fsdp"``), for messages."""
        return self.strategy.name

    @property
    def declared_unsupported_features(self) -> Dict[str, str]:
        """Conformance checks this backend or its strategy declares unsupported (check name -> why)."""
        return {**self.strategy.unsupported_features, **self.unsupported_features}

    @property
    def cluster_environment(self) -> ClusterEnvironment:
        """Where this run's processes come from (set by :meth:`setup`): ranks, rendezvous,
        and :meth:`~backends.environments.detection.ClusterEnvironment.requeue`."""
        return self.strategy.cluster_environment

    # -- life cycle -----------------------------------------------------------------
    def setup(self) -> None:
        """Find the cluster environment, pick the device, join the process group (DDP) and
        prepare the precision; every option was given to the constructors.

        If the precision refuses the device (fp16 on CPU), the process group is left again
        before the error propagates.
        """
        self.strategy.setup()
        try:
            self.precision.setup(self.device, None)
            self.strategy.configure_precision(self.precision.compute_dtype, self.precision.skips_nonfinite_steps)
        except BaseException:
            self.strategy.teardown()
            raise

    def teardown(self) -> None:
        """Leave the process group; safe to call more than once."""
        self.strategy.teardown()

    # -- data -----------------------------------------------------------------------
    def sampler_factory(self, shuffle: bool, seed: int) -> Callable[..., Any]:
        """The ``sampler`` callable handed to the module's data-loader methods.

        ``sampler(dataset)`` shuffles for training and keeps dataset order for evaluation;
        ``sampler(dataset, shuffle=False)`` keeps dataset order for training too (each rank's
        share in order; still padded to equal shares and resumable mid-epoch), and
        ``shuffle=True`` shuffles an evaluation set (not padded).
        """

        default_shuffle = shuffle

        def sampler(dataset: Sized, shuffle: Optional[bool] = None) -> Any:
            if shuffle is None or shuffle == default_shuffle:
                return self.strategy.create_sampler(dataset, shuffle=default_shuffle, seed=seed)
            if not isinstance(shuffle, bool):
                raise TypeError(f"sampler(dataset, shuffle={shuffle!r}): allowed: True, False or None (the default)")
            return self.strategy.create_sampler(dataset, shuffle=shuffle, seed=seed, pad=default_shuffle)

        return sampler

    def prepare_loader(self, loader: Any) -> Any:
        """The module's loader as this rank reads it (streams sharded by rank and worker)."""
        return self.strategy.prepare_loader(loader)

    def move_to_device(self, batch: Any) -> Any:
        """``batch`` with every tensor inside it on :attr:`device`.

        On a CPU device the batch is not walked: loaders yield CPU tensors, and walking the
        batch would cost more than a small model's step. A precision that converts inputs
        (true bf16) then casts its floating tensors.
        """
        if self.strategy.device.type != "cpu":
            batch = move_to_device(batch, self.device)
        return self.precision.convert_input(batch) if self._converts_input else batch

    # -- steps ----------------------------------------------------------------------
    def check_module(self, module: torch.nn.Module) -> None:
        """Refuse, before anything is built, a module the strategy cannot train (see :meth:`Strategy.check_module`)."""
        self.strategy.check_module(module)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module as the precision trains it (true bf16 casts it); called once, before
        :meth:`wrap_module` and before the optimizers are built."""
        return self.precision.convert_module(module)

    @property
    def skips_nonfinite_steps(self) -> bool:
        """True when the precision skips a step whose gradients are not finite (a GradScaler)."""
        return self.precision.skips_nonfinite_steps

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """What forwards compute in when it is not fp32 (None); known after :meth:`setup`."""
        return self.precision.compute_dtype

    def build_model(self, module: torch.nn.Module) -> None:
        """The module's ``configure_model()``, once, as the strategy builds models (``wrap_module`` calls it too)."""
        self.strategy.build_model(module)

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module training forwards go through (DDP and FSDP wrap it; the trainer has already
        let the precision convert it, see ``Precision.convert_module``)."""
        return self.strategy.wrap_module(module)

    def forward(self, runner: Callable[..., Any], *args: Any) -> Any:
        """Call ``runner(*args)`` inside the precision's autocast."""
        with self.precision.forward_context():
            return runner(*args)

    def step_function(self, wrapped: torch.nn.Module, runner: torch.nn.Module) -> Callable[..., Any]:
        """The call the training loop makes for every step, decided once: ``wrapped(*args)``
        inside the precision's autocast (through :meth:`forward`), or, when there is no wrapper
        (DDP), no autocast, no forward hook (FSDP2 registers its own) and no overridden
        :meth:`forward`, the runner's ``forward`` itself."""
        plain_forward = (
            type(self).forward is TrainerBackend.forward  # a plugin's own forward is always called
            and type(self.precision).forward_context is Precision.forward_context
        )
        if wrapped is runner and plain_forward and not _has_call_hooks(runner):
            return runner.forward
        return lambda *args: self.forward(wrapped, *args)

    def is_plain(self, call: str) -> bool:
        """True when ``call`` does what plain PyTorch does, so the training loop may do that
        itself, decided once: neither this backend's class nor its strategy's or precision's
        changes it. Plain ``no_sync`` is no context, plain ``backward`` is ``loss.backward()``,
        plain ``unscale_gradients`` is nothing and plain ``step_optimizers`` is
        ``optimizer.step()`` for each optimizer. (Each layer costs a small model a few
        microseconds a step; a plugin that overrides a call always has it called.)

        Example:
            >>> from backends import build_backend
            >>> [build_backend("sp").is_plain(call) for call in ("no_sync", "backward", "step_optimizers")]
            [True, True, True]
            >>> build_backend("sp-amp").is_plain("step_optimizers"), build_backend("ddp").is_plain("no_sync")
            (False, False)
        """
        if call not in _PLAIN_CALLS:
            raise ValueError(f"is_plain({call!r}): the calls a loop may make plainly are {sorted(_PLAIN_CALLS)}")
        owner, base = (self.strategy, Strategy) if call == "no_sync" else (self.precision, Precision)
        return getattr(type(self), call) is getattr(TrainerBackend, call) and getattr(type(owner), call) is getattr(base, call)

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        """Context for one micro-batch; skips the gradient all-reduce when asked."""
        return self.strategy.no_sync(wrapped, skip_gradient_sync)

    def prepare_for_backward(self, wrapped: torch.nn.Module, loss: torch.Tensor) -> None:
        """Called before every manual backward (DDP re-arms its gradient reducer there)."""
        self.strategy.prepare_for_backward(wrapped, loss)

    def refresh_parameters(self, wrapped: torch.nn.Module) -> None:
        """Called after every manual backward and optimizer step (FSDP gathers the shards again)."""
        self.strategy.refresh_parameters(wrapped)

    def inference(self, module: torch.nn.Module) -> ContextManager:
        """Context around forwards without a backward (validation, test, prediction) through
        ``module``; a sharded strategy leaves the parameters in their shards after it."""
        return self.strategy.inference(module)

    def discard_gradients(self, module: torch.nn.Module) -> None:
        """Drop every gradient of ``module``, those kept for the next synchronised backward too."""
        self.strategy.discard_gradients(module)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled, under fp16); ``args``/``kwargs`` go to ``Tensor.backward``."""
        if args or kwargs:
            self.precision.backward(loss, *args, **kwargs)
        else:
            self.precision.backward(loss)  # a plugin's precision may take the loss alone

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Make gradients true-sized before clipping."""
        self.precision.unscale_gradients(optimizers)

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        """Clip gradients (already unscaled) by value and/or total norm, whatever the parameters'
        meshes; returns the norm before clipping when ``max_norm`` is given (call on every rank)."""
        return self.strategy.clip_gradients(parameters, max_norm, max_value)

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        """Step the optimizers; False when the precision skipped the update."""
        return self.precision.step_optimizers(optimizers, closure)

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.strategy.all_reduce(tensor, op)

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over the data-parallel ranks (metrics: each share of the data counted once)."""
        return self.strategy.data_parallel_all_reduce(tensor, op)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return self.strategy.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self.strategy.broadcast_object(obj)

    def barrier(self) -> None:
        self.strategy.barrier()

    # -- decisions every rank takes together -------------------------------------------
    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        """For each flag, whether any rank set it (one collective for all of them)."""
        return self.strategy.any_rank(flags)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over ranks."""
        return self.strategy.min_over_ranks(value)

    def all_ranks_have_batch(self, has_batch: bool) -> bool:
        """True while every rank still has a batch (called per batch of a loader without a length)."""
        return self.strategy.all_ranks_have_batch(has_batch)

    def preemption_agreed(self, signal_pending: bool, global_step: int) -> bool:
        """Whether every rank stops at this step boundary because a preemption signal arrived."""
        return self.strategy.preemption_agreed(signal_pending, global_step)

    def gather_in_dataset_order(self, outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """This rank's joined evaluation outputs merged with every rank's, in dataset order."""
        return self.strategy.gather_in_dataset_order(outputs)

    def run_on_rank_zero(self, compute: Callable[[], Any], what: str, share_as: Tuple[Type[Exception], ...] = ()) -> Any:
        """``compute()`` on rank zero, its result (or its failure) on every rank; see
        :meth:`backends.strategies.strategy.Strategy.run_on_rank_zero`."""
        return self.strategy.run_on_rank_zero(compute, what, share_as)

    def raise_if_any_failed(self, error: Optional[BaseException], what: str) -> None:
        """Raise on every rank when any rank had ``error`` (call on every rank)."""
        self.strategy.raise_if_any_failed(error, what)

    def explain_failure(self, error: BaseException) -> Optional[str]:
        """A sentence on what a distributed failure means and what to change, or None."""
        return self.strategy.explain_failure(error)

    # -- checkpoints -----------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        """True when each rank holds only part of the parameters (``fsdp``)."""
        return self.strategy.shards_parameters

    @property
    def checkpoint_suffix(self) -> str:
        """``".pt"`` (one checkpoint file) or ``""`` (a directory of shards: ``fsdp``)."""
        return self.strategy.checkpoint_suffix

    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        """Prepare writing ``state`` to ``path`` and return the write (see :meth:`Strategy.save_checkpoint`)."""
        return self.strategy.save_checkpoint(path, state, io, copy)

    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        """What :meth:`save_checkpoint` wrote at ``path`` (see :meth:`Strategy.load_checkpoint`)."""
        return self.strategy.load_checkpoint(path, io, target, optimizers)

    def unsharded(self, state: Any) -> Any:
        """``state`` with sharded tensors gathered into full ones (collective under ``fsdp``)."""
        return self.strategy.unsharded(state)

    def local_shards(self, state: Any) -> Any:
        """``state`` with each sharded tensor replaced by this rank's part (no communication)."""
        return self.strategy.local_shards(state)

    # -- state ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the backend (the gradient scaler)."""
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.precision.load_state_dict(state.get("precision", {}))


_PLAIN_CALLS = frozenset({"no_sync", "backward", "unscale_gradients", "step_optimizers"})


def _has_call_hooks(module: torch.nn.Module) -> bool:
    """True when calling ``module`` runs hooks beside ``forward`` (FSDP2's, a user's, global ones)."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    global_hooks = (
        torch.nn.modules.module._global_forward_hooks,
        torch.nn.modules.module._global_forward_pre_hooks,
        torch.nn.modules.module._global_backward_hooks,
        torch.nn.modules.module._global_backward_pre_hooks,
    )
    return any(hooks) or any(global_hooks) or type(module).__call__ is not torch.nn.Module.__call__
