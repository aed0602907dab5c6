"""Where steps run: the :class:`Strategy` interface and the single-process strategy.

Strategy code owns the device, the process group, the sampler, the module wrapper,
``no_sync`` and the collectives. It never touches the gradient scaler. The multi-process
strategies live beside it: :class:`~backends.strategies.ddp.DDP` (``backends/strategies/ddp.py``) and
:class:`~backends.strategies.fsdp.FSDP` (``backends/strategies/fsdp.py``).
"""

import contextlib
import logging
from typing import Any, Callable, ClassVar, ContextManager, Dict, List, Optional, Sequence, Sized, Tuple, Type, TypeVar, Union

import torch

from backends.checkpoint_io.base import CheckpointIO, is_sharded_checkpoint
from backends.data.samplers import ResumableSampler
from backends.data.streams import shard_stream
from backends.environments.detection import ClusterEnvironment, LocalEnvironment, check_launch, select_cluster_environment
from backends.options import BackendArguments, strategy_options
from backends.strategies.gradient_clipping import clip_gradients
from backends.strategies.meta_init import configure_model, has_meta_tensors, materialize
from backends.strategies.units import compile_units, module_units

logger = logging.getLogger(__name__)

_NO_CONTEXT = contextlib.nullcontext()  # reusable: nothing to enter or leave

S = TypeVar("S", bound="Strategy")


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

    Every option is a constructor argument (a registered backend's factory passes the run's
    ``TrainerArguments``, see :meth:`from_arguments`); :meth:`setup` takes none.

    Args:
        use_gpu: None: a GPU when present; True: require one; False: CPU.
        cluster: where the processes come from: a registered cluster environment's name
            (``"slurm"``), an instance, or None to detect it when :meth:`setup` runs.
        compile: :meth:`wrap_module` compiles the module's units with ``torch.compile``.

    Example:
        >>> strategy = SingleProcess(use_gpu=False)
        >>> strategy.setup()
        >>> strategy.device, strategy.world_size, strategy.is_main_process
        (device(type='cpu'), 1, True)
    """

    name = "single-process"
    multi_process = False
    """True for strategies that run one process per device (DDP); False refuses multi-process launches."""
    shards_parameters = False
    """True when each rank holds only part of the parameters (FSDP): whole-module work (export)
    must gather them first or refuse."""
    checkpoint_suffix = ".pt"
    """What follows ``checkpoint-<step>`` in a checkpoint's name: ``".pt"`` for one file,
    ``""`` for a directory of shards (see :meth:`save_checkpoint`)."""
    unsupported_features: ClassVar[Dict[str, str]] = {}
    """Conformance checks the strategy declares unsupported (check name -> why; see
    :attr:`backends.TrainerBackend.unsupported_features`)."""

    def __init__(
        self, use_gpu: Optional[bool] = None, cluster: Union[str, ClusterEnvironment, None] = None, compile: bool = False
    ) -> None:
        if use_gpu not in (None, True, False):
            raise ValueError(f"{type(self).__name__}(use_gpu={use_gpu!r}) is invalid; allowed: None, True, False")
        if cluster is not None and not isinstance(cluster, (str, ClusterEnvironment)):
            raise TypeError(
                f"{type(self).__name__}(cluster={cluster!r}) is invalid; allowed: None (detect), a registered cluster "
                "environment's name such as 'slurm', or a backends.ClusterEnvironment"
            )
        if not isinstance(compile, bool):
            raise TypeError(f"{type(self).__name__}(compile={compile!r}) is invalid; allowed: True, False")
        self.use_gpu = use_gpu
        self.cluster = cluster
        self.compile = compile
        self.device = torch.device("cpu")
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.cluster_environment: ClusterEnvironment = LocalEnvironment({})

    @classmethod
    def from_arguments(cls: Type[S], args: Optional[BackendArguments] = None) -> S:
        """This strategy built with the options it takes from a run's arguments (None: defaults).

        Subclasses with more options (DDP, FSDP) read theirs too; a plugin strategy whose
        constructor takes other arguments overrides it.

        Example:
            >>> from types import SimpleNamespace
            >>> SingleProcess.from_arguments(SimpleNamespace(use_gpu=False, compile=True)).options
            {'use_gpu': False, 'cluster': None, 'compile': True}
        """
        return cls(**strategy_options(args))

    @property
    def options(self) -> Dict[str, Any]:
        """The backend options this strategy takes, by their ``TrainerArguments`` names, with the
        values it was built with (see :func:`backends.options.check_backend_options`)."""
        cluster = self.cluster.name if isinstance(self.cluster, ClusterEnvironment) else self.cluster
        return {"use_gpu": self.use_gpu, "cluster": cluster, "compile": self.compile}

    @property
    def is_main_process(self) -> bool:
        """True on the rank that prints, logs and writes files."""
        return self.rank == 0

    # -- data-parallel identity: what every reader of data reads, never the global rank ---------
    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this rank reads: samplers, stream shards, resume positions,
        gathers and per-rank state go by it. Ranks that hold parts of one model replica (tensor
        parallel peers) share it; here (one replica per rank) it is :attr:`rank`."""
        return self.rank

    @property
    def data_parallel_size(self) -> int:
        """How many distinct shares the data is split into (the global batch over them); here :attr:`world_size`."""
        return self.world_size

    def data_parallel_representatives(self) -> List[int]:
        """One global rank per data-parallel rank, in data-parallel order (which entry of a list
        gathered from every rank speaks for each share of the data)."""
        return list(range(self.world_size))

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over the data-parallel ranks only (a sum counts each share of the
        data once); here over every rank, as :meth:`all_reduce`."""
        return self.all_reduce(tensor, op)

    def check_module(self, module: torch.nn.Module) -> None:
        """Refuse a module this strategy cannot train, before anything is built (the
        model-parallel strategy needs a tensor-parallel plan); here every module is fine."""

    def clip_gradients(
        self, parameters: Sequence[torch.Tensor], max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        """Clip the gradients of ``parameters`` by value and/or total norm (whatever their meshes:
        see :mod:`backends.strategies.gradient_clipping`); the norm before clipping when ``max_norm`` is given.
        Collective where parameters are sharded or pipelined: call it on every rank (under a
        pipeline, the norm is every stage's together: :meth:`pipeline_group`)."""
        return clip_gradients(parameters, max_norm, max_value, pipeline_group=self.pipeline_group())

    def pipeline_group(self) -> Optional[Any]:
        """The process group of this rank's pipeline (its peers that hold the other stages), or None
        without pipeline parallelism (here)."""
        return None

    def setup(self) -> None:
        """Find the cluster environment (the ``cluster`` option, detected when None), take the
        ranks from it, check that the launch fits the strategy, and pick the device (subclasses
        then join the process group).

        Raises:
            ValueError: several processes were launched for a single-process strategy
                (see :func:`backends.environments.detection.check_launch`), or ``cluster`` names no
                registered environment.
        """
        environment = select_cluster_environment(self.cluster)
        check_launch(environment, self.multi_process)
        self.cluster_environment = environment
        self.rank, self.local_rank, self.world_size = environment.global_rank, environment.local_rank, environment.world_size
        self.device = select_device(self.use_gpu, self.local_rank)
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
        return ResumableSampler(
            dataset, shuffle=shuffle, seed=seed, rank=self.data_parallel_rank, world_size=self.data_parallel_size, pad=pad
        )

    def prepare_loader(self, loader: Any) -> Any:
        """The module's loader, ready for this rank: a stream (``IterableDataset``) is sharded by
        data-parallel rank and by loader worker (see :class:`~backends.data.streams.ShardedStream`)."""
        return shard_stream(loader, self.data_parallel_rank, self.data_parallel_size)

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module that training forwards go through (``module``: the step runner). Calls the
        module's ``configure_model()`` first, and allocates and initializes layers built on the
        meta device (see :mod:`backends.strategies.meta_init`)."""
        target = getattr(module, "module", module)
        self.build_model(module)
        if has_meta_tensors(target):  # built under torch.device("meta"): allocated and initialized here
            materialize(target, self.device)
        self.compile_units(target, module_units(target))
        return module

    def build_model(self, module: torch.nn.Module) -> None:
        """Call the module's ``configure_model()`` once, as this strategy builds models (here: as it
        is, its layers drawn from the run's seed; the sharding strategies: on the meta device).
        :meth:`wrap_module` calls it; the trainer calls it first where the built layers must be
        seen before wrapping (activation checkpointing's units). ``module``: the step runner."""
        target = getattr(module, "module", module)
        if self.shards_parameters:  # fsdp, model-parallel: no memory until sharded, then each rank's shards
            configure_model(target, on_meta=True)
            return
        with torch.random.fork_rng(devices=[]):  # the layers it builds are drawn from the run's seed
            torch.manual_seed(torch.initial_seed())
            configure_model(target, on_meta=False)

    def compile_units(self, module: torch.nn.Module, units: List[torch.nn.Module]) -> None:
        """With ``compile`` on, ``torch.compile`` each unit in place (see :func:`backends.strategies.units.compile_units`)."""
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
            from backends.checkpoint_io import sharded_checkpoint  # DCP: imported only when used

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

    def inference(self, module: torch.nn.Module) -> ContextManager:
        """Context around forwards without a backward through ``module`` (the step runner):
        validation, test and prediction. A sharded strategy gathers the parameters from their
        shards inside it and leaves them sharded after it, so whatever reads or writes the
        parameters between passes (a weight average swapped in, a checkpoint loaded, the next
        training forward) sees the shards; nothing to do where parameters are whole."""
        return _NO_CONTEXT

    def discard_gradients(self, module: torch.nn.Module) -> None:
        """Drop every gradient of ``module``, also those a backward under :meth:`no_sync` keeps
        for the next synchronised one (after a probe whose gradients must not reach a step)."""
        for parameter in module.parameters():
            parameter.grad = None

    def explain_failure(self, error: BaseException) -> Optional[str]:
        """A sentence on what a distributed failure means and what to change, or None."""
        return None


def _write_nothing() -> None:
    """The write of a rank that writes nothing."""


class SingleProcess(Strategy):
    """One process: CUDA if available (``use_gpu``), else CPU. A launch of several processes
    (torchrun, srun, mpirun) is refused in :meth:`setup`, before any step.

    Args: as :class:`Strategy` (``use_gpu``, ``cluster``, ``compile``). DDP's options are not
    taken: ``TrainerArguments.find_unused_parameters=True`` with an ``sp`` backend is an error
    (see :func:`backends.options.check_backend_options`).

    Example:
        >>> SingleProcess().world_size
        1
    """
