"""The DDP strategy: one process per device under ``torch.distributed``, under any launcher."""

import atexit
import datetime
import itertools
import logging
import sys
import time
from typing import Any, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from backends.data.batch import map_tensors
from backends.data.samplers import interleave_ranks
from backends.environments.detection import ClusterEnvironment
from backends.options import BackendArguments, option, strategy_options
from backends.strategies.buffers import broadcast_buffers
from backends.strategies.ddp_ready_order import reduce_in_ready_order
from backends.strategies.ddp_wrap_options import check_wrap_options
from backends.strategies.strategy import _NO_CONTEXT, Strategy

logger = logging.getLogger(__name__)

_SETUPS = itertools.count()  # DDP set-ups in this process: every rank sets up its trainers in the same order
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_over(tensor: torch.Tensor, op: str, size: int, group: Any = None) -> torch.Tensor:
    """``tensor`` reduced (``mean``, ``sum``, ``max`` or ``min``) over the ``size`` ranks of ``group``
    (None: every rank); a new tensor. Collective: call it on every rank of the group."""
    if op != "mean" and op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; allowed: {['mean', *_REDUCE_OPS]}")
    result = tensor.clone()
    dist.all_reduce(result, op=_REDUCE_OPS["sum" if op == "mean" else op], group=group)
    return result / size if op == "mean" else result


class DDP(Strategy):
    """``torch.distributed`` data parallel, one process per device, under any launcher.

    Ranks, world size and the rendezvous address come from the cluster environment
    (torchrun, ``srun``, ``mpirun`` or a registered one; see ``backends/environments/detection.py``).
    Launched as one process it runs as one, so the same script works under ``python``,
    ``torchrun`` and ``srun``. The process group uses NCCL on CUDA and gloo on CPU, is
    created once by :meth:`setup` (rank zero serves the store, unless torchrun's agent
    does) and destroyed by :meth:`teardown`.

    Args:
        find_unused_parameters: passed to ``DistributedDataParallel`` (a model whose loss
            skips some parameters in a step needs it).
        timeout_seconds: how long a collective may wait for a missing rank before the
            job fails instead of hanging (``TrainerArguments.ddp_timeout``).
        wrap_options: more keyword arguments for ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``static_graph``, ...), checked here against its signature.
            The ones the strategy controls (``device_ids``, ``output_device``, ``process_group``,
            ``device_mesh``, ``mixed_precision``, and ``find_unused_parameters``, which is the
            parameter above) are refused (see :mod:`backends.strategies.ddp_wrap_options`).
            To compute them per model, override :meth:`ddp_kwargs`.
        use_gpu, cluster, compile: as for :class:`~backends.strategies.strategy.Strategy`.

    Example:
        >>> strategy = DDP(use_gpu=False, timeout_seconds=60)   # under torchrun or srun: ranks come from the launcher
        >>> strategy.setup()
        >>> strategy.world_size >= 1
        True
        >>> DDP(wrap_options={"bucket_cap_mb": 50, "static_graph": True}).ddp_kwargs(torch.nn.Linear(2, 2))
        {'bucket_cap_mb': 50, 'static_graph': True}
    """

    name = "ddp"
    multi_process = True

    def __init__(
        self,
        find_unused_parameters: bool = False,
        timeout_seconds: float = 600.0,
        *,
        wrap_options: Optional[Mapping[str, Any]] = None,
        use_gpu: Optional[bool] = None,
        cluster: Union[str, ClusterEnvironment, None] = None,
        compile: bool = False,
    ) -> None:
        super().__init__(use_gpu=use_gpu, cluster=cluster, compile=compile)
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(f"DDP(find_unused_parameters={find_unused_parameters!r}) is invalid; allowed: True, False")
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds={timeout_seconds!r} (ddp_timeout) is invalid; allowed: seconds > 0")
        self.find_unused_parameters = find_unused_parameters
        self.timeout_seconds = float(timeout_seconds)
        self.wrap_options: Dict[str, Any] = {}
        if wrap_options is not None:
            self._add_wrap_options(wrap_options, f"{type(self).__name__}(wrap_options=...)")
        self._owns_process_group = False
        self._preemption_registered = False
        self._preemption_stop_step: Optional[int] = None
        self._preemption_keys = "framework/preempt/0"
        self._store_lost = False  # the store is unreachable: stops are agreed at log points (all-reduce)

    @classmethod
    def from_arguments(cls, args: Optional[BackendArguments] = None) -> "DDP":
        """DDP built with ``find_unused_parameters``, ``ddp_timeout`` (as ``timeout_seconds``),
        ``use_gpu``, ``cluster`` and ``compile`` from a run's arguments (None: defaults).

        Example:
            >>> from types import SimpleNamespace
            >>> DDP.from_arguments(SimpleNamespace(ddp_timeout=30.0)).timeout_seconds
            30.0
        """
        return cls(
            find_unused_parameters=option(args, "find_unused_parameters"),
            timeout_seconds=option(args, "ddp_timeout"),
            **strategy_options(args),
        )

    def with_wrap_options(self, **wrap_options: Any) -> "DDP":
        """This strategy, with more keyword arguments for ``DistributedDataParallel`` (checked as
        ``wrap_options`` are); for a factory that builds it from the run's arguments.

        Example:
            >>> DDP.from_arguments(None).with_wrap_options(gradient_as_bucket_view=True).wrap_options
            {'gradient_as_bucket_view': True}
        """
        self._add_wrap_options(wrap_options, f"{type(self).__name__}.with_wrap_options()")
        return self

    def _add_wrap_options(self, wrap_options: Mapping[str, Any], given_as: str) -> None:
        checked = check_wrap_options(wrap_options, given_as)
        if self.shards_parameters and checked:  # FSDP, ModelParallel: they shard instead of wrapping
            raise ValueError(f"{given_as}: {type(self).__name__} shards parameters; it never wraps with DistributedDataParallel")
        self.wrap_options = {**self.wrap_options, **checked}

    @property
    def options(self) -> Dict[str, Any]:
        return {
            **super().options,
            "find_unused_parameters": self.find_unused_parameters,
            "ddp_timeout": self.timeout_seconds,
        }

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    def setup(self) -> None:
        """Take the ranks from the cluster environment, pick the device and join the process
        group (when the world size is > 1).

        Raises:
            ValueError: the environment lacks its rendezvous address (``WORLD_SIZE`` > 1
                without ``MASTER_ADDR``/``MASTER_PORT``).
        """
        super().setup()
        # Preemption keys of this run in the group's store: another trainer in the same group (set up
        # in the same order on every rank) must not read this one's counts.
        self._preemption_keys = f"framework/preempt/{next(_SETUPS)}"
        if dist.is_initialized():
            # A process group made by the caller: use its ranks, leave destroying it to the caller.
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if not self.distributed or dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        dist.init_process_group(
            backend=backend,
            store=_rendezvous_store(self.cluster_environment, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self._owns_process_group = True
        atexit.register(self.teardown)
        logger.debug("%s joined the %s process group on %s", self.cluster_environment.describe(), backend, self.device)

    def teardown(self) -> None:
        """Destroy the process group this strategy created (not one made by the caller).

        Called by the trainer when training raises, and at interpreter exit. While an
        exception is being handled on a CUDA (NCCL) group, pending collectives are aborted
        rather than waited for, so a failing rank never blocks on peers that are gone.

        Without an error the ranks first meet at a barrier (so it is collective then: call it
        on every rank), so that no rank leaves while another still talks to it.

        On gloo it then sleeps 0.1 s: gloo's worker threads free the tensors of finished
        collectives, which needs the GIL, and destroying the process group does not stop
        them (DDP still references it). A worker thread still waiting for the GIL when the
        interpreter shuts down aborts the process ("terminate called without an active
        exception", SIGABRT), which happened under CPU contention to scripts that end right
        after a collective such as ``all_gather_object``. Sleeping hands the GIL over.
        """
        if not (self._owns_process_group and dist.is_initialized()):
            self._owns_process_group = False
            return
        uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set once a script died
        failing = sys.exc_info()[0] is not None or uncaught is not None
        if not failing:
            try:
                self.barrier()
            except Exception as error:  # a peer that is gone must not stop us from leaving
                logger.debug("barrier before destroying the process group failed: %s", error)
        self._owns_process_group = False
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if failing and self.device.type == "cuda" and abort is not None:
            abort()
        else:
            dist.destroy_process_group()
        if self.device.type == "cpu":
            time.sleep(0.1)

    def ddp_kwargs(self, module: torch.nn.Module) -> Dict[str, Any]:
        """The keyword arguments ``DistributedDataParallel`` gets for ``module`` besides the ones the
        strategy controls (devices, process group, ``find_unused_parameters``): ``wrap_options``.

        Override it to compute them from the model (e.g. ``static_graph`` only for some models);
        what it returns is checked like ``wrap_options`` at each wrap.

        Example:
            >>> class BigBuckets(DDP):
            ...     def ddp_kwargs(self, module):
            ...         return {**super().ddp_kwargs(module), "bucket_cap_mb": 100}
            >>> BigBuckets().ddp_kwargs(torch.nn.Linear(2, 2))
            {'bucket_cap_mb': 100}
        """
        return dict(self.wrap_options)

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().wrap_module(module)  # compiles the units when asked
        extra = check_wrap_options(self.ddp_kwargs(module), f"{type(self).__name__}.ddp_kwargs()")  # in one process too
        if not self.distributed:
            return module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        unused = self.find_unused_parameters
        wrapped = DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=unused, **extra)
        reduce_in_ready_order(wrapped)  # a resumed run on more than 2 ranks sums its gradients as the run it continues
        return wrapped

    def inference(self, module: torch.nn.Module) -> ContextManager:
        """Evaluate on rank zero's buffers (see :mod:`backends.strategies.buffers`): DDP broadcast them at the
        step's first forward and each rank has updated its own since (batch norm), so each rank
        would evaluate other running statistics than the ones a checkpoint (rank zero's) keeps."""
        if self.distributed:
            broadcast_buffers(module)
        return _NO_CONTEXT

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        if skip_gradient_sync and isinstance(wrapped, DistributedDataParallel):
            if wrapped.static_graph:  # torch's reducer asserts (expect_autograd_hooks_) on a no_sync backward of step 1
                raise ValueError(
                    "DistributedDataParallel(static_graph=True) (a DDP wrap option) cannot skip the gradient sync of a "
                    "micro-batch (gradient accumulation: torch's reducer fails on the first step); allowed: static_graph="
                    "False, or no accumulation (gpu_batch_size_limit >= train_batch_size / world size, or None)"
                )
            return wrapped.no_sync()
        return _NO_CONTEXT

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not self.distributed:
            return tensor.clone()
        return reduce_over(tensor, op, self.world_size)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        if not self.distributed:
            return super().any_rank(flags)
        reduced = self.all_reduce(torch.tensor([float(flag) for flag in flags], device=self.device), "max")
        return [value > 0 for value in reduced.tolist()]

    def min_over_ranks(self, value: int) -> int:
        if not self.distributed:
            return value
        return int(self.all_reduce(torch.tensor(value, device=self.device), "min"))

    def all_ranks_have_batch(self, has_batch: bool) -> bool:
        if not self.distributed:
            return has_batch
        return bool(self.all_reduce(torch.tensor(float(has_batch), device=self.device), "min").item())

    def gather_in_dataset_order(self, outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not self.distributed:
            return outputs
        gathered = self.all_gather_object(map_tensors(outputs, torch.Tensor.cpu))
        return interleave_ranks([gathered[rank] for rank in self.data_parallel_representatives()])

    def preemption_agreed(self, signal_pending: bool, global_step: int) -> bool:
        """Agree on one stop step without a collective while no signal is pending.

        torchrun and srun forward a signal to every rank, but each sees it at its own step
        boundary, and DDP keeps ranks within one optimizer step of each other (no rank
        finishes step ``s + 1`` before every rank has joined its gradient all-reduce). A rank
        with a pending signal writes the step it has reached to the process group's store and
        counts itself in; once every rank is counted, each computes the same stop step, one
        past the largest step written, which no rank has passed yet. Store reads happen only
        on a rank that has a signal pending.

        When the store cannot be reached (torchrun's agent, which serves it, died), this
        returns False from then on and the ranks agree at the next log point instead, where
        every rank's stop request already rides on the loss all-reduce over the process group.
        """
        if not self.distributed:
            return signal_pending
        if self._preemption_stop_step is None and signal_pending and not self._store_lost:
            try:
                self._register_preemption(global_step)
            except (RuntimeError, OSError) as error:  # DistNetworkError: the launcher serving the store is gone
                self._store_lost = True
                logger.warning(
                    "rank %d: the store the ranks agree through is unreachable (%s: %s; its launcher died?): the ranks "
                    "agree on the stop at the next log point instead, over the process group",
                    self.rank,
                    type(error).__name__,
                    (str(error).strip().splitlines() or [""])[0][:200],
                )
        return self._preemption_stop_step is not None and global_step >= self._preemption_stop_step

    def _register_preemption(self, global_step: int) -> None:
        """Count this rank in at the store; once every rank is, compute the stop step."""
        store = dist.distributed_c10d._get_default_store()
        if not self._preemption_registered:
            store.set(f"{self._preemption_keys}/step/{self.rank}", str(global_step))
            store.add(f"{self._preemption_keys}/ranks", 1)
            self._preemption_registered = True
        if store.add(f"{self._preemption_keys}/ranks", 0) == self.world_size:
            steps = [int(store.get(f"{self._preemption_keys}/step/{rank}")) for rank in range(self.world_size)]
            self._preemption_stop_step = max(steps) + 1
            logger.debug("rank %d: every rank has a signal pending; stopping at step %d", self.rank, self._preemption_stop_step)

    def prepare_for_backward(self, wrapped: torch.nn.Module, loss: torch.Tensor) -> None:
        """Re-arm DDP's reducer for one more backward of the same forward (manual optimization).

        DDP arms its reducer once per forward; a second ``backward`` through that forward
        (a GAN's discriminator loss) needs it armed again, with the graph of this loss
        searched for unused parameters when ``find_unused_parameters`` is on.
        """
        if not isinstance(wrapped, DistributedDataParallel) or not torch.is_grad_enabled():
            return
        if not wrapped.require_backward_grad_sync:
            return
        wrapped.require_forward_param_sync = True
        reducer = wrapped.reducer
        reducer._rebuild_buckets()
        reducer.prepare_for_backward([loss] if wrapped.find_unused_parameters and not wrapped.static_graph else [])

    def explain_failure(self, error: BaseException) -> Optional[str]:
        text = str(error).lower()
        if self.distributed and "find_unused_parameters" in text and not self.find_unused_parameters:
            return (
                "DDP found parameters that did not receive a gradient in this step (a branch or a network the loss "
                "did not use, e.g. a GAN's generator in the discriminator's backward); set "
                "TrainerArguments.find_unused_parameters=True (--trainer.find_unused_parameters true) for a model "
                "whose graph skips parameters. DDP said: " + str(error).strip().splitlines()[0][:300]
            )
        if self.distributed and ("timed out" in text or "timeout" in text):
            return (
                f"a collective waited longer than ddp_timeout={self.timeout_seconds:g}s for another rank: a rank is "
                "stuck or died. If steps, validation or saves legitimately take longer, raise "
                "TrainerArguments.ddp_timeout (--trainer.ddp_timeout SECONDS). The collective said: "
                + str(error).strip().splitlines()[0][:300]
            )
        return None

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def _rendezvous_store(environment: ClusterEnvironment, timeout: datetime.timedelta) -> dist.Store:
    """The store the ranks meet through, at the environment's master address and port.

    Rank zero serves it, except under torchrun's agent store (:func:`_per_attempt_store`).
    """
    agent_store = _per_attempt_store(environment, timeout)
    if agent_store is not None:
        return agent_store
    return dist.TCPStore(
        environment.master_address,
        environment.master_port,
        environment.world_size,
        is_master=environment.global_rank == 0,
        timeout=timeout,
    )


def _per_attempt_store(environment: ClusterEnvironment, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Where the launcher serves the store (torchrun), a client namespaced by the restart attempt (else None).

    torchrun shares its rendezvous store with the workers across restarts; without a
    per-attempt prefix, restarted gloo workers can read addresses that workers of the dead
    attempt published, and fail or hang while connecting (pytorch/pytorch#135712).
    """
    if not environment.launcher_store:
        return None
    client = dist.TCPStore(
        environment.master_address, environment.master_port, environment.world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"framework/attempt_{environment.restart_count}", client)
