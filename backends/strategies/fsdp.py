"""Fully sharded data parallel on FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank keeps 1/world_size of every parameter, gradient and optimizer state; a unit's
parameters are all-gathered just before its forward (and backward) and freed after.
Process-group handling, samplers and collectives are the DDP strategy's.
"""

import contextlib
import functools
import logging
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from backends.checkpoint_io.base import CheckpointIO, is_sharded_checkpoint
from backends.data.batch import map_tensors
from backends.environments.detection import ClusterEnvironment
from backends.options import BackendArguments, option, strategy_options
from backends.strategies.buffers import BufferBroadcast, broadcast_buffers
from backends.strategies.ddp import DDP
from backends.strategies.dtensors import full_cpu_tensor as _full_cpu_tensor
from backends.strategies.dtensors import is_dtensor as _is_dtensor
from backends.strategies.dtensors import local_tensor as _local_tensor
from backends.strategies.dtensors import sharded_parameter_count  # noqa: F401 - its public home was here
from backends.strategies.hsdp import check_replicate_size, checked_replicate_size, hsdp_mesh
from backends.strategies.meta_init import materialize
from backends.strategies.pipeline import PipelineParallel
from backends.strategies.read_agreement import agree_readable, raise_on_every_rank
from backends.strategies.units import module_units, shard_groups, units_tied_to_root

logger = logging.getLogger(__name__)


class FSDP(PipelineParallel, DDP):
    """Shards parameters, gradients and optimizer state over the ranks (FSDP2), launched by torchrun.

    Units: the module's ``sharding_units()`` when it defines one, else every block of every
    ``nn.ModuleList`` and ``nn.ModuleDict`` in it; then the root (everything left: embeddings, heads). With one rank
    nothing is sharded and it trains like ``sp``. Checkpoints are sharded (every rank writes
    its shards, ``torch.distributed.checkpoint``; see :mod:`backends.checkpoint_io.sharded_checkpoint`) and
    can be resumed on another world size, or read whole in one process.

    Mixed precision (``fsdp-amp``): parameters are all-gathered in the precision's compute
    dtype (bf16) and gradients reduce-scattered in fp32 (FSDP2 ``MixedPrecisionPolicy``); the
    sharded fp32 parameters are the master weights the optimizer steps. The precision's
    autocast stays on around the forward, so the ops autocast keeps in fp32 (softmax,
    losses, norms) still run in fp32. fp16 with a GradScaler is refused (its inf check would
    not be agreed over shards): use bfloat16.

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward (less
            memory, one more all-gather in backward); the root never reshards
            (``TrainerArguments.reshard_after_forward``).
        timeout_seconds: as for :class:`~backends.strategies.ddp.DDP` (``TrainerArguments.ddp_timeout``).
        data_parallel_replicate_size: HSDP's replica groups, usually the nodes (:mod:`backends.strategies.hsdp`); None: 1.
        pipeline_parallel_size, pipeline_schedule: pipeline stages, ``pp`` outermost (:mod:`backends.strategies.pipeline`).
        use_gpu, cluster, compile: as for :class:`~backends.strategies.strategy.Strategy`.
            ``find_unused_parameters`` is not taken: FSDP2 needs no search for unused parameters.

    Example:
        >>> strategy = FSDP(reshard_after_forward=False, use_gpu=False)   # under torchrun: ranks from the environment
        >>> strategy.setup()
        >>> strategy.checkpoint_suffix  # a checkpoint is a directory of shards
        ''
    """

    name = "fsdp"
    shards_parameters = True
    checkpoint_suffix = ""

    def __init__(
        self,
        reshard_after_forward: bool = True,
        timeout_seconds: float = 600.0,
        *,
        use_gpu: Optional[bool] = None,
        cluster: Union[str, ClusterEnvironment, None] = None,
        compile: bool = False,
        data_parallel_replicate_size: Optional[int] = None,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
    ) -> None:
        super().__init__(
            find_unused_parameters=False,
            timeout_seconds=timeout_seconds,
            use_gpu=use_gpu,
            cluster=cluster,
            compile=compile,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_schedule=pipeline_schedule,
        )
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"FSDP(reshard_after_forward={reshard_after_forward!r}) is invalid; allowed: True, False")
        self.reshard_after_forward = reshard_after_forward
        self.requested_replicate_size = checked_replicate_size(data_parallel_replicate_size)
        self.data_parallel_replicate_size = data_parallel_replicate_size or 1
        self.param_dtype: Optional[torch.dtype] = None
        self._checkpoint_group: Any = None
        self._buffer_owner: Optional[torch.nn.Module] = None  # the sharded root, whose buffers rank zero decides
        self._buffer_rule: Optional[BufferBroadcast] = None

    @classmethod
    def from_arguments(cls, args: Optional[BackendArguments] = None) -> "FSDP":
        """FSDP built with ``reshard_after_forward``, ``ddp_timeout``, ``use_gpu``, ``cluster`` and
        ``compile`` from a run's arguments (None: defaults).

        Example:
            >>> from types import SimpleNamespace
            >>> FSDP.from_arguments(SimpleNamespace(reshard_after_forward=False)).reshard_after_forward
            False
        """
        return cls(
            reshard_after_forward=option(args, "reshard_after_forward"),
            timeout_seconds=option(args, "ddp_timeout"),
            data_parallel_replicate_size=option(args, "data_parallel_replicate_size"),
            pipeline_parallel_size=option(args, "pipeline_parallel_size"),
            pipeline_schedule=option(args, "pipeline_schedule"),
            **strategy_options(args),
        )

    @property
    def options(self) -> Dict[str, Any]:
        options = {**super().options, "reshard_after_forward": self.reshard_after_forward, **self.pipeline_options}
        options["data_parallel_replicate_size"] = self.requested_replicate_size
        del options["find_unused_parameters"]
        return options

    def setup(self) -> None:
        """Join the process group (as DDP); ValueError (the group left again) if the replicas do not divide the ranks."""
        super().setup()
        try:
            self._settle_layout()
        except BaseException:
            self.teardown()
            raise

    def _settle_layout(self) -> None:
        if self.pipelined:  # pp outermost: every other dimension is inside one stage
            self.build_pipeline_mesh()
        check_replicate_size(self.data_parallel_replicate_size, self.data_parallel_size, f"{self.world_size} processes")

    def configure_precision(self, compute_dtype: Optional[torch.dtype], uses_grad_scaler: bool) -> None:
        if uses_grad_scaler:
            raise ValueError(
                "fsdp-amp with a GradScaler (amp_dtype='float16') is not supported: the scaler's inf check would "
                "not be agreed over the shards; use amp_dtype='bfloat16'"
            )
        self.param_dtype = compute_dtype

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Shard every unit of the user's module, then the root (``module``: the step runner)."""
        if self.pipelined:
            return self.wrap_pipeline(module)
        target = getattr(module, "module", module)  # the StepRunner's ModuleInterface
        self.build_model(module)
        units = module_units(target)
        mesh = self.sharding_mesh(target) if self.distributed else None
        if mesh is None:  # nothing to shard over (one data-parallel rank)
            materialize(target, self.device)
            self.compile_units(target, units)
            return module
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not units:
            logger.warning(
                "%s: %s has no sharding units (sharding_units() returned none and it holds no nn.ModuleList or "
                "nn.ModuleDict blocks), so the whole model is one unit: every rank all-gathers all its parameters at "
                "once; define sharding_units() to return the blocks to shard one by one",
                self.name,
                type(target).__name__,
            )
        tied = units_tied_to_root(target, units)
        if tied:  # FSDP2 keeps a parameter in one group: these are sharded with the root instead
            logger.warning(
                "%s: %s shares parameters with the root (%s), so each is sharded with the root, whose parameters stay "
                "gathered; to shard them one by one, keep the tied weight inside one unit (return a module holding "
                "both ends from sharding_units())",
                self.name,
                ", ".join(f"unit {unit!r}" for unit in tied),
                ", ".join(f"{unit}: {parameter}" for unit, parameter in tied.items()),
            )
            dropped = {id(target.get_submodule(name)) for name in tied}
            units = [unit for unit in units if id(unit) not in dropped]
        broadcast_from_rank_zero(module)  # every rank then shards rank zero's weights, as DDP starts from them
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32 if self.param_dtype else None)
        if self.param_dtype is not None:  # batch norms keep fp32 weights beside their fp32 running statistics
            for norm in _batch_norms(target, units):
                fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=self.reshard_after_forward)
        for group in shard_groups(units):  # inner units first; units with tied weights together
            fully_shard(
                group if len(group) > 1 else group[0],
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=self.reshard_after_forward,
            )
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        materialize(target, self.device)  # meta-built layers: each rank allocates and initializes its shards
        module.set_reduce_scatter_unused_params(True)  # type: ignore[operator]  # unused parameters: zeros, on every rank
        self._buffer_owner = module
        if any(not _is_dtensor(buffer) for buffer in module.buffers()):  # batch norm's running statistics: rank 0's
            self._buffer_rule = BufferBroadcast(module)
        self.compile_units(target, units)  # after sharding: FSDP's hooks stay outside the compiled code
        logger.debug("rank %d: sharded %d unit(s) and the root over %d ranks", self.rank, len(units), mesh.size())
        return module

    def explain_failure(self, error: BaseException) -> Optional[str]:
        explained = super().explain_failure(error)
        if explained is not None and "ddp_timeout" in explained:  # a collective that one rank never joined
            explained += (
                f" Under {self.name}, a rank also waits there when a sharding unit's forward ran on some ranks and not "
                "on others (a unit returned by sharding_units() that only some samples reach, such as one expert): "
                "keep such branches inside one unit, as the default units do."
            )
        return explained

    def sharding_mesh(self, module: torch.nn.Module) -> Any:
        """The mesh ``fully_shard`` shards over, once the module is ready for it (None: do not
        shard); here every rank (a 1-D mesh), or ``("dp_replicate", "dp_shard")`` under HSDP."""
        from torch.distributed.device_mesh import init_device_mesh

        if (replicas := self.data_parallel_replicate_size) > 1:
            return hsdp_mesh(self.device.type, replicas, self.world_size // replicas)
        return init_device_mesh(self.device.type, (self.world_size,))

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        if not skip_gradient_sync or not hasattr(wrapped, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return _without_gradient_sync(wrapped, self._buffer_rule)

    def prepare_for_backward(self, wrapped: torch.nn.Module, loss: torch.Tensor) -> None:
        """Make a manual backward reduce-scatter every gradient, as the automatic one does.

        Under manual optimization ``train_step`` (and so each backward) runs inside the
        root's forward, before FSDP2 hooks the root's outputs; without a hook on ``loss`` the
        gradients of the root's parameters would stay on the unsharded copies and the
        optimizer (holding the shards) would never see them. The root's pre-backward hook
        queues FSDP2's end-of-backward callback, which reduce-scatters every group.
        """
        state = _fsdp_state(wrapped)
        if state is not None and torch.is_grad_enabled() and loss.requires_grad:
            loss.register_hook(state._pre_backward)

    def refresh_parameters(self, wrapped: torch.nn.Module) -> None:
        """Gather the root's parameters again after a manual backward (which resharded them)
        or optimizer step (which changed the shards), for the rest of ``train_step``."""
        if _fsdp_state(wrapped) is None:
            return
        _reshard(wrapped)
        wrapped.unshard()  # type: ignore[operator]

    def inference(self, module: torch.nn.Module) -> ContextManager:
        """Reshard every unit before and after forwards without a backward.

        After a forward under ``no_grad`` no backward reshards the units FSDP2 keeps gathered
        (the root always, every unit with ``reshard_after_forward=False``): their gathered
        copies would stay registered on the module, so a weight average swapped into the
        shards afterwards, or a checkpoint loaded into them, would not reach the next
        forward (which would train on the stale copy), and ``module.parameters()`` would
        not be the parameters the optimizer holds. Resharding on entry too drops a copy
        gathered before the shards were changed (manual optimization keeps the root gathered).
        Every rank evaluates rank zero's buffers (see :mod:`backends.strategies.buffers`).
        """
        if _fsdp_state(module) is None:
            return contextlib.nullcontext()
        if self._buffer_rule is not None:
            broadcast_buffers(module)
        return _resharded_around(module)

    def discard_gradients(self, module: torch.nn.Module) -> None:
        """Drop the gradients, also the unsharded ones FSDP2 keeps from a backward under
        :meth:`no_sync` for the next synchronised backward, which would reduce-scatter them
        into the next step. The root's ``reset_iter_state`` first: after a probe that ran out
        of memory mid-backward, FSDP2's per-iteration state is reset as it documents."""
        if _fsdp_state(module) is not None:
            module.reset_iter_state()  # type: ignore[operator]
            _drop_unsynchronised_gradients(module)
        super().discard_gradients(module)

    def unsharded(self, state: Any) -> Any:
        """``state`` with every sharded tensor all-gathered into a full CPU tensor (call it on every rank)."""
        return self.every_stage(map_tensors(state, _full_cpu_tensor))  # a pipeline: every stage's entries

    def local_shards(self, state: Any) -> Any:
        return map_tensors(state, _local_tensor)

    # -- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str, state: Dict[str, Any], io: CheckpointIO, copy: bool = False) -> Callable[[], None]:
        """Prepare a sharded save into the directory ``path``: every rank writes its shards, rank
        zero the rest (see :mod:`backends.checkpoint_io.sharded_checkpoint`). With ``copy`` (a background write)
        the shards are copied to CPU first and DCP's collectives run over a process group of
        their own, so they never interleave with training's."""
        from backends.checkpoint_io import sharded_checkpoint  # DCP: imported only when used

        if self._buffer_owner is not None:  # every rank's buffers are rank zero's, which DCP may or may not write
            broadcast_buffers(self._buffer_owner)
        group = None
        if copy and self.distributed:
            if self._checkpoint_group is None:
                self._checkpoint_group = dist.new_group(backend="gloo")  # collective: every rank saves together
            group = self._checkpoint_group
        return sharded_checkpoint.prepare_save(
            path,
            state,
            io,
            is_main=self.is_main_process,
            distributed=self.distributed,
            on_rank_zero=self.run_on_rank_zero,
            process_group=group,
            copy=copy,
            stage_group=self.pipeline_group(),  # a pipeline: rank zero's state.pt names every stage's tensors
        )

    def load_checkpoint(
        self,
        path: str,
        io: CheckpointIO,
        target: Optional[Callable[[], Dict[str, Any]]] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Dict[str, Any]:
        """Every rank reads its own shards of the checkpoint directory ``path`` into ``target()``'s
        tensors (this run's sharding, any world size wrote it); without ``target``, full tensors.

        Raises:
            ValueError: ``path`` is a whole-model file (``sp``/``ddp``), which this strategy does not resume.
        """
        from backends.checkpoint_io import sharded_checkpoint  # DCP: imported only when used

        if target is not None and self.distributed:
            agree_readable(path, io, self.all_gather_object)
        if not is_sharded_checkpoint(path):
            if target is None:
                return io.read(path)
            raise ValueError(
                f"{path} is a whole-model checkpoint file (written by sp or ddp); the {self.name} strategy resumes "
                "sharded checkpoint directories: resume it with the backend that wrote it, or load its weights with "
                "framework.checkpoint.load_weights"
            )
        agree = functools.partial(raise_on_every_rank, gather=self.all_gather_object)  # before DCP's collectives
        return sharded_checkpoint.load(
            path, io, target, optimizers, distributed=self.distributed, one_stage=self.pipelined, agree=agree
        )


def _batch_norms(module: torch.nn.Module, units: Sequence[torch.nn.Module]) -> "list[torch.nn.Module]":
    """The batch norms in ``module`` with parameters, other than units themselves: under a bf16
    ``param_dtype`` each is sharded as its own unit in full precision, as FSDP1 kept them (PyTorch's
    CPU kernel refuses a bf16 weight beside fp32 running statistics; the CUDA path is untested here)."""
    return [
        child
        for child in module.modules()
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm) and child.affine and not any(child is unit for unit in units)
    ]


def broadcast_from_rank_zero(module: torch.nn.Module) -> None:
    """Give every rank rank zero's parameters and buffers, in place (collective over every rank).

    ``fully_shard`` keeps each rank's own slice of its own tensors: ranks that initialised
    differently (seeded by rank, or not at all) would train a mix of their weights. Tensors
    already split by tensor parallelism (DTensors) are left alone: their placement was decided
    when they were distributed (from rank zero's weights, broadcast before).

    Example:
        >>> broadcast_from_rank_zero(torch.nn.Linear(2, 2))  # one process: nothing to do
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if _is_dtensor(tensor) or tensor.is_meta:  # meta: initialized alike on every rank once allocated
                continue
            data = torch.view_as_real(tensor.data) if tensor.is_complex() else tensor.data
            dist.broadcast(data, src=0)


@contextlib.contextmanager
def _without_gradient_sync(wrapped: Any, buffer_rule: Optional[BufferBroadcast]) -> Iterator[None]:
    wrapped.set_requires_gradient_sync(False)
    if buffer_rule is not None:
        buffer_rule.gradient_sync = False
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)
        if buffer_rule is not None:
            buffer_rule.gradient_sync = True


@contextlib.contextmanager
def _resharded_around(module: torch.nn.Module) -> Iterator[None]:
    _reshard(module)
    try:
        yield
    finally:
        _reshard(module)


def _reshard(module: torch.nn.Module) -> None:
    """Free every unit's gathered parameters: the module holds its shards (DTensors) again."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _drop_unsynchronised_gradients(module: torch.nn.Module) -> None:
    """Each unit's unsharded gradients kept under ``set_requires_gradient_sync(False)``: on the
    unsharded parameter, or (when it reduces in another dtype) upcast beside it. FSDP2 has no
    public call for this; its parameter objects are reached through each unit's state."""
    for state in (_fsdp_state(unit) for unit in module.modules()):
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]  # older: one
        for group in filter(None, groups):
            for parameter in group.fsdp_params:
                parameter.unsharded_accumulated_grad = None
                unsharded = getattr(parameter, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def _fsdp_state(wrapped: torch.nn.Module) -> Any:
    """The FSDP2 state of the root module (None when it was not sharded: one rank)."""
    from torch.distributed.fsdp import FSDPModule

    return wrapped._get_fsdp_state() if isinstance(wrapped, FSDPModule) else None
