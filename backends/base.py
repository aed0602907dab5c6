"""TrainerBackend: the one object the Trainer talks to, a strategy composed with a precision."""

import logging
from typing import Any, Callable, ClassVar, ContextManager, Dict, List, Optional, Sequence, Sized, Union

import torch

from backends.batch import move_to_device
from backends.environments import ClusterEnvironment, select_cluster_environment
from backends.precision import FullPrecision, Precision
from backends.strategies import SingleProcess, Strategy

logger = logging.getLogger(__name__)


class TrainerBackend:
    """Decides where and how each step runs: ``strategy`` (devices, processes, gradient
    sync) times ``precision`` (autocast, loss scaling).

    The built-in backends are compositions: ``sp`` is ``TrainerBackend(SingleProcess(),
    FullPrecision())`` and ``ddp-amp`` is ``TrainerBackend(DDP(), MixedPrecision())``. A
    plugin subclasses this class (or a strategy or precision) and overrides what it needs;
    see ``docs/backends.md``.

    Args:
        strategy: where steps run (default: :class:`SingleProcess`).
        precision: how numbers are represented (default: :class:`FullPrecision`).

    Example:
        >>> from backends import TrainerBackend, SingleProcess, MixedPrecision
        >>> backend = TrainerBackend(SingleProcess(), MixedPrecision("bfloat16"))
        >>> backend.setup(use_gpu=False)
        >>> backend.device
        device(type='cpu')
    """

    unsupported_features: ClassVar[Dict[str, str]] = {}
    """Conformance checks this backend declares it does not support, by check name (``"manual"``,
    ``"resume"``...) with the reason; ``python -m framework.conformance`` reports them as declared
    refusals instead of running them. The backend must then refuse the feature before step 1."""
    resume_tolerance: float = 0.0
    """Largest parameter difference between a resumed run and an uninterrupted one that the
    conformance kit accepts (0.0: bitwise, what the built-in backends promise)."""

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
    def cluster_environment(self) -> ClusterEnvironment:
        """Where this run's processes come from (set by :meth:`setup`): ranks, rendezvous,
        and :meth:`~backends.environments.ClusterEnvironment.requeue`."""
        return self.strategy.cluster_environment

    # -- life cycle -----------------------------------------------------------------
    def setup(
        self,
        use_gpu: Optional[bool] = None,
        amp_dtype: Optional[str] = None,
        find_unused_parameters: bool = False,
        ddp_timeout: float = 600.0,
        cluster: Union[str, ClusterEnvironment, None] = None,
        compile: bool = False,
    ) -> None:
        """Find the cluster environment, pick the device, join the process group (DDP) and
        prepare the precision.

        ``cluster`` names a registered cluster environment (``"slurm"``), or is one, or is
        None to detect it. ``compile``: the strategy compiles the module's units with
        ``torch.compile`` when it wraps the module; the first training step's time
        (compilation included) is logged once. If the precision refuses the device (fp16 on
        CPU), the process group is left again before the error propagates.
        """
        self.strategy.setup(
            use_gpu=use_gpu,
            find_unused_parameters=find_unused_parameters,
            ddp_timeout=ddp_timeout,
            cluster_environment=select_cluster_environment(cluster),
            compile=compile,
        )
        try:
            self.precision.setup(self.device, amp_dtype)
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

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        """Context for one micro-batch; skips the gradient all-reduce when asked."""
        return self.strategy.no_sync(wrapped, skip_gradient_sync)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled, under fp16); ``args``/``kwargs`` go to ``Tensor.backward``."""
        if args or kwargs:
            self.precision.backward(loss, *args, **kwargs)
        else:
            self.precision.backward(loss)  # a plugin's precision may take the loss alone

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Make gradients true-sized before clipping."""
        self.precision.unscale_gradients(optimizers)

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], closure: Any = None) -> bool:
        """Step the optimizers; False when the precision skipped the update."""
        return self.precision.step_optimizers(optimizers, closure)

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.strategy.all_reduce(tensor, op)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return self.strategy.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self.strategy.broadcast_object(obj)

    def barrier(self) -> None:
        self.strategy.barrier()

    # -- state ----------------------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the backend (the gradient scaler)."""
        return {"precision": self.precision.get_state()}

    def update_state(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`get_state` returned."""
        self.precision.update_state(state.get("precision", {}))


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
