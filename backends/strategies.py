"""Where steps run: one process, or one process per device under ``torch.distributed`` DDP.

Strategy code owns the device, the process group, the sampler, the module wrapper,
``no_sync`` and the collectives. It never touches the gradient scaler.
"""

import atexit
import contextlib
import datetime
import logging
import sys
import time
from typing import Any, Callable, ClassVar, ContextManager, Dict, List, Optional, Sequence, Sized, Tuple, Type

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from backends.batch import map_tensors
from backends.checkpoint_io import CheckpointIO, is_sharded_checkpoint
from backends.environments import ClusterEnvironment, LocalEnvironment, check_launch, select_cluster_environment
from backends.samplers import ResumableSampler, interleave_ranks
from backends.streams import shard_stream
from backends.units import compile_units, module_units

logger = logging.getLogger(__name__)

_NO_CONTEXT = contextlib.nullcontext()  # reusable: nothing to enter or leave

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def select_device(use_gpu: Optional[bool], local_rank: int = 0) -> torch.device:
    """CUDA device ``local_rank`` when wanted and present, else CPU.

    ``use_gpu=None`` means "a GPU if there is one"; ``True`` makes a missing GPU an error.
    """
    if use_gpu and not torch.cuda.is_available():
        raise ValueError("use_gpu=True but torch.cuda.is_available() is False; set use_gpu to None or False")
    if use_gpu is False or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible; launch at most {count} "
            f"processes per node (torchrun --nproc_per_node={count}) or set use_gpu=False"
        )
    return torch.device("cuda", local_rank)


class Strategy:
    """One process on one device: the ``sp`` strategy, and the base of every other.

    Example:
        >>> strategy = SingleProcess()
        >>> strategy.setup(use_gpu=False)
        >>> strategy.device, strategy.world_size, strategy.is_main_process
        (device(type='cpu'), 1, True)
    """

    name = "single-process"
    multi_process = False
    """True for strategies that run one process per device (DDP); False refuses multi-process launches."""
    checkpoint_suffix = ".pt"
    """What follows ``checkpoint-<step>`` in a checkpoint's name: ``".pt"`` for one file,
    ``""`` for a directory of shards (see :meth:`save_checkpoint`)."""
    unsupported_features: ClassVar[Dict[str, str]] = {}
    """Conformance checks the strategy declares unsupported (check name -> why; see
    :attr:`backends.TrainerBackend.unsupported_features`)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.cluster_environment: ClusterEnvironment = LocalEnvironment({})
        self.compile = False

    @property
    def is_main_process(self) -> bool:
        """True on the rank that prints, logs and writes files."""
        return self.rank == 0

    def setup(
        self,
        use_gpu: Optional[bool] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        compile: bool = False,
        **options: Any,
    ) -> None:
        """Take ranks from the cluster environment (detected when None), check that the launch
        fits the strategy, and pick the device (subclasses then join the process group).
        ``compile``: :meth:`wrap_module` compiles the module's units with ``torch.compile``.

        Raises:
            ValueError: several processes were launched for a single-process strategy
                (see :func:`backends.environments.check_launch`).
        """
        environment = cluster_environment if cluster_environment is not None else select_cluster_environment()
        check_launch(environment, self.multi_process)
        self.cluster_environment = environment
        self.rank, self.local_rank, self.world_size = environment.global_rank, environment.local_rank, environment.world_size
        self.compile = bool(compile)
        self.device = select_device(use_gpu, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def teardown(self) -> None:
        """Release what :meth:`setup` acquired; safe to call twice."""

    def create_sampler(self, dataset: Sized, shuffle: bool, seed: int, pad: Optional[bool] = None) -> ResumableSampler:
        """The sampler for ``dataset``: shuffled for training, ordered for evaluation.

        ``pad`` (default: ``shuffle``) evens the ranks' shares by repeating samples: training
        pads (no rank waits for another), evaluation does not (each sample counts once).
        """
        pad = shuffle if pad is None else pad
        return ResumableSampler(dataset, shuffle=shuffle, seed=seed, rank=self.rank, world_size=self.world_size, pad=pad)

    def prepare_loader(self, loader: Any) -> Any:
        """The module's loader, ready for this rank: a stream (``IterableDataset``) is sharded by
        rank and by loader worker (see :class:`~backends.streams.ShardedStream`)."""
        return shard_stream(loader, self.rank, self.world_size)

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module that training forwards go through (``module``: the step runner)."""
        target = getattr(module, "module", module)
        self.compile_units(target, module_units(target))
        return module

    def compile_units(self, module: torch.nn.Module, units: List[torch.nn.Module]) -> None:
        """With ``compile`` on, ``torch.compile`` each unit in place (see :func:`backends.units.compile_units`)."""
        if self.compile:
            compiled = compile_units(module, units)
            logger.info("torch.compile: compiling %d unit(s) of %s on first use", len(compiled), type(module).__name__)

    def configure_precision(self, compute_dtype: Optional[torch.dtype], uses_grad_scaler: bool) -> None:
        """Told once what the precision computes in (None: fp32) and whether it scales losses."""

    def unsharded(self, state: Any) -> Any:
        """``state`` with sharded tensors gathered into full ones (collective where sharded; call on every rank)."""
        return state

    def local_shards(self, state: Any) -> Any:
        """``state`` with each sharded tensor replaced by the part this rank holds (no communication)."""
        return state

    # -- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        """Prepare writing ``state`` to ``path``; return the write, to run now or on a background
        thread. Call on every rank, with the same arguments.

        Here (one process, DDP): rank zero writes one file with ``io.write``; the other ranks'
        write does nothing. ``copy``: the state is copied (``io.stage``) before returning, so
        training may change it while the write runs.
        """
        if not self.is_main_process:
            return _write_nothing
        data = io.stage(state) if copy else state
        return lambda: io.write(path, data)

    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        """What :meth:`save_checkpoint` wrote at ``path`` (call on every rank: each reads it).

        ``target`` returns this run's state (a sharded strategy loads into its tensors, and
        creates ``optimizers``' state first); here the file is read whole with ``io.read``, and a
        sharded checkpoint directory is read with full tensors (so a sharded run resumes here).

        Raises:
            CorruptCheckpoint: the checkpoint is damaged (resuming falls back to an older one).
            CheckpointRefused: safe loading refuses it.
        """
        if is_sharded_checkpoint(path):
            from backends import sharded_checkpoint  # DCP: imported only when used

            return sharded_checkpoint.load(path, io)
        return io.read(path)

    def run_on_rank_zero(self, compute: Callable[[], Any], what: str, share_as: Tuple[Type[Exception], ...] = ()) -> Any:
        """``compute()`` on rank zero, its result returned on every rank (call on every rank).

        A failure there is raised on every rank, so no rank waits for a rank that gave up: rank
        zero raises its own error; the others a RuntimeError (or the first of ``share_as`` the
        error is an instance of) saying ``"rank zero <what>: <error>"``.

        Example:
            >>> SingleProcess().run_on_rank_zero(lambda: 42, "failed to compute the answer")
            42
        """
        result, error = None, None
        if self.is_main_process:
            try:
                result = compute()
            except Exception as caught:  # re-raised below, after the other ranks learn about it
                error = caught
        if self.world_size > 1:
            failure = None
            if error is not None:
                kind = next((index for index, shared in enumerate(share_as) if isinstance(error, shared)), None)
                failure = (f"{type(error).__name__}: {error}", kind)
            result, failure = self.broadcast_object((result, failure))
            if error is None and failure is not None:
                message, kind = failure
                raise (RuntimeError if kind is None else share_as[kind])(f"rank zero {what}: {message}")
        if error is not None:
            raise error
        return result

    def raise_if_any_failed(self, error: Optional[BaseException], what: str) -> None:
        """Agree on a failure that any rank may have had (call on every rank): this rank's
        ``error`` is raised here, and a rank without one raises a RuntimeError naming the other
        rank's. Also a barrier."""
        if self.world_size > 1:
            failures = self.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
            if error is None:
                for rank, failure in enumerate(failures):
                    if failure is not None:
                        raise RuntimeError(f"rank {rank} failed to {what}: {failure}")
        if error is not None:
            raise error

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        """Context for one micro-batch: inside it, gradients accumulate without communication."""
        return _NO_CONTEXT

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over ranks (``mean``, ``sum``, ``max`` or ``min``); a new tensor."""
        return tensor.clone()

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank zero's ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    # -- decisions every rank must take together ------------------------------------
    def any_rank(self, flags: Sequence[bool]) -> List[bool]:
        """For each flag, whether any rank set it (one tiny all-reduce for all of them)."""
        return [bool(flag) for flag in flags]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over ranks (e.g. the epoch length every rank can reach)."""
        return value

    def all_ranks_have_batch(self, has_batch: bool) -> bool:
        """True while every rank still has a batch (a stream without a length ends for all at once)."""
        return has_batch

    def gather_in_dataset_order(self, outputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """This rank's joined evaluation outputs merged with every rank's, in dataset order."""
        return outputs

    def preemption_agreed(self, signal_pending: bool, global_step: int) -> bool:
        """Whether every rank stops at this step boundary because a preemption signal arrived.

        Called at every step boundary; costs nothing while no signal is pending here.
        """
        return signal_pending

    def prepare_for_backward(self, wrapped: torch.nn.Module, loss: torch.Tensor) -> None:
        """Called before every manual backward (DDP re-arms its gradient reducer there)."""

    def refresh_parameters(self, wrapped: torch.nn.Module) -> None:
        """Called after every manual backward and optimizer step, inside ``train_step``
        (FSDP gathers the updated shards again there); nothing to do where parameters are whole."""

    def explain_failure(self, error: BaseException) -> Optional[str]:
        """A sentence on what a distributed failure means and what to change, or None."""
        return None


def _write_nothing() -> None:
    """The write of a rank that writes nothing."""


class SingleProcess(Strategy):
    """One process: CUDA if available (``use_gpu``), else CPU. A launch of several processes
    (torchrun, srun, mpirun) is refused in :meth:`setup`, before any step.

    Example:
        >>> SingleProcess().world_size
        1
    """


class DDP(Strategy):
    """``torch.distributed`` data parallel, one process per device, under any launcher.

    Ranks, world size and the rendezvous address come from the cluster environment
    (torchrun, ``srun``, ``mpirun`` or a registered one; see ``backends/environments.py``).
    Launched as one process it runs as one, so the same script works under ``python``,
    ``torchrun`` and ``srun``. The process group uses NCCL on CUDA and gloo on CPU, is
    created once by :meth:`setup` (rank zero serves the store, unless torchrun's agent
    does) and destroyed by :meth:`teardown`.

    Args:
        find_unused_parameters: passed to ``DistributedDataParallel`` (None: from the
            trainer arguments).
        timeout_seconds: how long a collective may wait for a missing rank before the
            job fails instead of hanging (None: from the trainer arguments).

    Example:
        >>> strategy = DDP()   # under torchrun or srun: ranks come from the launcher
        >>> strategy.setup(use_gpu=False)
        >>> strategy.world_size >= 1
        True
    """

    name = "ddp"
    multi_process = True

    def __init__(self, find_unused_parameters: Optional[bool] = None, timeout_seconds: Optional[float] = None) -> None:
        super().__init__()
        self.find_unused_parameters = find_unused_parameters
        self.timeout_seconds = timeout_seconds
        self._owns_process_group = False
        self._preemption_registered = False
        self._preemption_stop_step: Optional[int] = None
        self._store_lost = False  # the store is unreachable: stops are agreed at log points (all-reduce)

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    def setup(
        self,
        use_gpu: Optional[bool] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        compile: bool = False,
        *,
        find_unused_parameters: bool = False,
        ddp_timeout: float = 600.0,
        **options: Any,
    ) -> None:
        """Take the ranks from the cluster environment, pick the device and join the process
        group (when the world size is > 1).

        Raises:
            ValueError: ``ddp_timeout`` is not positive, or the environment lacks its
                rendezvous address (``WORLD_SIZE`` > 1 without ``MASTER_ADDR``/``MASTER_PORT``).
        """
        if ddp_timeout is not None and not ddp_timeout > 0:
            raise ValueError(f"ddp_timeout={ddp_timeout!r} is invalid; allowed: seconds > 0")
        super().setup(use_gpu, cluster_environment, compile, **options)
        if dist.is_initialized():
            # A process group made by the caller: use its ranks, leave destroying it to the caller.
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.find_unused_parameters is None:
            self.find_unused_parameters = find_unused_parameters
        if self.timeout_seconds is None:
            self.timeout_seconds = ddp_timeout
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

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().wrap_module(module)  # compiles the units when asked
        if not self.distributed:
            return module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=self.find_unused_parameters)

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        if skip_gradient_sync and isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync()
        return _NO_CONTEXT

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        result = tensor.clone()
        if not self.distributed:
            return result
        if op == "mean":
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            return result / self.world_size
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} is not supported; allowed: {['mean', *_REDUCE_OPS]}")
        dist.all_reduce(result, op=_REDUCE_OPS[op])
        return result

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
        return interleave_ranks(self.all_gather_object(map_tensors(outputs, torch.Tensor.cpu)))

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
            store.set(f"framework/preempt/step/{self.rank}", str(global_step))
            store.add("framework/preempt/ranks", 1)
            self._preemption_registered = True
        if store.add("framework/preempt/ranks", 0) == self.world_size:
            steps = [int(store.get(f"framework/preempt/step/{rank}")) for rank in range(self.world_size)]
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
