"""Tensor parallelism and FSDP2 on a 2-D ``("dp", "tp")`` device mesh: the model-parallel strategy.

The ranks form a grid of ``data_parallel_size`` rows by ``tensor_parallel_size`` columns
(rank ``r`` sits at row ``r // tp``, column ``r % tp``). Along ``tp`` the ranks of one row
hold parts of one model replica, split by the module's tensor-parallel plan
(``torch.distributed.tensor.parallel.parallelize_module``); they read identical batches. Along
``dp`` the rows are data parallel, and each row's parameters are sharded over the rows by FSDP2
(``fully_shard``), as the ``fsdp`` strategy does over every rank. Order (torchtitan's): tensor
parallelism, then activation checkpointing and ``torch.compile`` where asked (the trainer
wraps each unit's forward for checkpointing before the strategy runs, which is the same as
wrapping it after: the plan works on submodules and parameters, not on ``forward``), then
``fully_shard`` of the module's ``sharding_units()`` and the root over ``dp``.
"""

import contextlib
import logging
from typing import Any, ContextManager, Dict, List, Optional, Tuple, Union

import torch

from backends.data.batch import map_tensors
from backends.environments.detection import ClusterEnvironment
from backends.options import BackendArguments, option, strategy_options
from backends.strategies.ddp import reduce_over
from backends.strategies.fsdp import FSDP, broadcast_from_rank_zero
from backends.strategies.hsdp import DATA_DIM, HSDP_DIM_NAMES, check_replicate_size, hsdp_mesh

logger = logging.getLogger(__name__)

LOSS_PARALLEL_ATTRIBUTE = "uses_loss_parallel"
"""A module that sets this class attribute True computes its loss on vocabulary-sharded logits
(a ``Shard(-1)`` DTensor from the head): the strategy keeps ``loss_parallel()`` open around each
micro-batch's forward and backward, and around evaluation."""

DEFAULT_PARALLELIZE_MARK = "_applies_tensor_parallel_plan"
"""Set on a ``parallelize`` method that only applies ``tensor_parallel_plan()`` (the framework's
default): such a module needs a plan."""


def custom_parallelize(module: torch.nn.Module) -> bool:
    """True when ``module`` defines its own ``parallelize(tp_mesh)`` (not the default that applies the plan)."""
    method = getattr(module, "parallelize", None)
    return callable(method) and not getattr(method, DEFAULT_PARALLELIZE_MARK, False)


def tensor_parallel_plan(module: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """``module.tensor_parallel_plan()`` (None when it has none).

    Raises:
        TypeError: the plan is not a dict of submodule names to ``ParallelStyle``.
    """
    method = getattr(module, "tensor_parallel_plan", None)
    plan = method() if callable(method) else None
    if plan is None:
        return None
    from torch.distributed.tensor.parallel import ParallelStyle

    valid = isinstance(plan, dict) and all(
        isinstance(key, str) and isinstance(style, ParallelStyle) for key, style in plan.items()
    )
    if not valid:
        raise TypeError(
            f"{type(module).__name__}.tensor_parallel_plan() must return a dict of submodule names to ParallelStyle "
            f"(ColwiseParallel(), RowwiseParallel(), ...); got {plan!r}"
        )
    return plan


TieSite = Tuple[str, str]
"""Where a parameter is registered: (the submodule's name, the attribute)."""


def tied_parameters(module: torch.nn.Module) -> List[List[TieSite]]:
    """The parameters registered in more than one place (tied weights), each as its sites in module order.

    Example:
        >>> net = torch.nn.ModuleDict({"embed": torch.nn.Embedding(4, 2), "head": torch.nn.Linear(2, 4, bias=False)})
        >>> net.head.weight = net.embed.weight
        >>> tied_parameters(net)
        [[('embed', 'weight'), ('head', 'weight')]]
    """
    sites: Dict[int, List[TieSite]] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        for attribute, parameter in submodule._parameters.items():
            if parameter is not None:
                site = (name, attribute)
                if site not in sites.setdefault(id(parameter), []):
                    sites[id(parameter)].append(site)
    return [group for group in sites.values() if len(group) > 1]


def _layout(parameter: torch.Tensor) -> str:
    placements = getattr(parameter, "placements", None)
    return "whole on every rank" if placements is None else "split as " + ", ".join(map(repr, placements))


def retie(module: torch.nn.Module, groups: List[List[TieSite]]) -> None:
    """Tie each group's parameters again after the tensor-parallel split, which gives each site its own
    DTensor: the first site's parameter is registered at every other site (one DTensor, one gradient).

    Raises:
        ValueError: the split laid the sites of a tie out differently (naming them and their layouts).
    """
    for group in groups:
        parameters = [getattr(module.get_submodule(name), attribute) for name, attribute in group]
        layouts = [_layout(parameter) for parameter in parameters]
        mesh_of = [getattr(parameter, "device_mesh", None) for parameter in parameters]
        if len(set(layouts)) > 1 or len({id(mesh) for mesh in mesh_of}) > 1:
            names = [f"{name}.{attribute}" if name else attribute for name, attribute in group]
            described = "; ".join(f"{name}: {layout}" for name, layout in zip(names, layouts))
            raise ValueError(
                f"{' and '.join(names)} are one tied parameter, but the tensor-parallel plan lays them out differently "
                f"({described}); give every site the same layout (for a tied embedding and output head: "
                "RowwiseParallel() on the embedding and ColwiseParallel() on the head, both split by vocabulary rows), "
                "leave both out of the plan, or untie them"
            )
        for name, attribute in group[1:]:
            setattr(module.get_submodule(name), attribute, parameters[0])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made a plain tensor on every rank (differentiable: no copy when replicated); else ``tensor``."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _reopen_loss_parallel() -> None:
    """Loss parallelism on again inside the strategy's ``loss_parallel()``, after a ``train_step``'s own
    ``with loss_parallel():`` turned it off on its way out (torch's context is not reentrant: its exit
    removes the loss ops whoever else opened them); the strategy's exit then closes it once."""
    from torch.distributed.tensor.parallel import loss

    enable = getattr(loss, "_enable_custom_loss_ops", None)  # torch's own step of loss_parallel()'s entry
    if enable is not None:
        enable()


class ModelParallel(FSDP):
    """Tensor parallel within a group of ranks, FSDP2 data parallel across the groups.

    The module says how its layers split: ``tensor_parallel_plan()`` (names relative to the
    module, wildcards as ``parallelize_module`` takes them: ``{"layers.*.attention.wq":
    ColwiseParallel()}``) or, for full control, ``parallelize(tp_mesh)``. A module with neither
    is refused by :meth:`check_module`, before anything is built. Data goes by
    :attr:`data_parallel_rank` (the row): tensor-parallel peers read identical batches and
    share their per-rank state; ``train_batch_size`` is divided over the rows. Checkpoints are
    DCP shards (as ``fsdp``), resumable on any mesh shape or one process.

    Args:
        tensor_parallel_size: ranks per model replica (``TrainerArguments.tensor_parallel_size``);
            None: the processes of one node. Must divide the world size (checked in :meth:`setup`).
        data_parallel_replicate_size: HSDP over the rows: they form this many replica groups, each sharding
            the parameters over its rows, gradients all-reduced across groups (a ``("dp_replicate",
            "dp_shard", "tp")`` mesh; usually the number of nodes); must divide the data-parallel size. None: 1.
        reshard_after_forward, timeout_seconds, use_gpu, cluster, compile: as for
            :class:`~backends.strategies.fsdp.FSDP`.

    Example:
        >>> strategy = ModelParallel(tensor_parallel_size=2, use_gpu=False)  # torchrun --nproc_per_node=4: a 2x2 mesh
        >>> strategy.tensor_parallel_size
        2
    """

    name = "model-parallel"

    def __init__(
        self,
        tensor_parallel_size: Optional[int] = None,
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
            reshard_after_forward,
            timeout_seconds,
            use_gpu=use_gpu,
            cluster=cluster,
            compile=compile,
            data_parallel_replicate_size=data_parallel_replicate_size,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_schedule=pipeline_schedule,
        )
        if tensor_parallel_size is not None and (
            isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1
        ):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size!r} is invalid; allowed: None (the processes of one node) "
                "or an integer >= 1 that divides the world size"
            )
        self.requested_tensor_parallel_size = tensor_parallel_size
        self.tensor_parallel_size = tensor_parallel_size or 1
        self.device_mesh: Any = None
        self.loss_parallel = False
        self._loss_parallel_open = False  # inside the strategy's loss_parallel() (a micro-batch, an evaluation)

    @classmethod
    def from_arguments(cls, args: Optional[BackendArguments] = None) -> "ModelParallel":
        """ModelParallel built with ``tensor_parallel_size``, ``reshard_after_forward``, ``ddp_timeout``,
        ``use_gpu``, ``cluster`` and ``compile`` from a run's arguments (None: defaults).

        Example:
            >>> from types import SimpleNamespace
            >>> ModelParallel.from_arguments(SimpleNamespace(tensor_parallel_size=2)).tensor_parallel_size
            2
        """
        return cls(
            tensor_parallel_size=option(args, "tensor_parallel_size"),
            reshard_after_forward=option(args, "reshard_after_forward"),
            timeout_seconds=option(args, "ddp_timeout"),
            data_parallel_replicate_size=option(args, "data_parallel_replicate_size"),
            pipeline_parallel_size=option(args, "pipeline_parallel_size"),
            pipeline_schedule=option(args, "pipeline_schedule"),
            **strategy_options(args),
        )

    @property
    def options(self) -> Dict[str, Any]:
        return {**super().options, "tensor_parallel_size": self.requested_tensor_parallel_size}

    # -- the grid -----------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:  # pp outermost: the place inside this stage's block of ranks
        return (self.rank % self.ranks_per_stage) // self.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.ranks_per_stage // self.tensor_parallel_size

    @property
    def tensor_parallel_rank(self) -> int:
        """This rank's column: which part of each split layer it holds."""
        return self.rank % self.tensor_parallel_size

    def data_parallel_representatives(self) -> List[int]:  # the last stage's (where the loss is)
        last = (self.pipeline_parallel_size - 1) * self.ranks_per_stage
        return [last + row * self.tensor_parallel_size for row in range(self.data_parallel_size)]

    def setup(self) -> None:
        """Join the process group, check ``tensor_parallel_size`` against the world size and
        ``data_parallel_replicate_size`` against the data-parallel size, and build the mesh:
        ``("dp", "tp")``, or ``("dp_replicate", "dp_shard", "tp")`` with ``"dp"`` their flattening.

        Raises:
            ValueError: ``tensor_parallel_size`` does not divide the world size, or the replicas the
                data-parallel size (the process group is left again first).
        """
        super().setup()
        if self.pipelined:  # ("pp", "dp_replicate", "dp_shard", "tp"), "dp" flattened
            self.device_mesh = self.build_pipeline_mesh(self.tensor_parallel_size)
        elif self.distributed and (replicas := self.data_parallel_replicate_size) > 1:
            shard = self.data_parallel_size // replicas
            self.device_mesh = hsdp_mesh(self.device.type, replicas, shard, self.tensor_parallel_size)
        elif self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.data_parallel_size, self.tensor_parallel_size)
            self.device_mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("dp", "tp"))
        logger.debug(
            "rank %d: data-parallel rank %d of %d, tensor-parallel rank %d of %d",
            self.rank,
            self.data_parallel_rank,
            self.data_parallel_size,
            self.tensor_parallel_rank,
            self.tensor_parallel_size,
        )

    def _settle_layout(self) -> None:  # inside FSDP.setup: the tensor-parallel size first, then the replicas
        self.tensor_parallel_size = self._resolve_tensor_parallel_size()
        self.check_pipeline_layout(self.tensor_parallel_size)
        described = f"{self.world_size} processes / tensor_parallel_size {self.tensor_parallel_size}"
        check_replicate_size(self.data_parallel_replicate_size, self.data_parallel_size, described)

    def _resolve_tensor_parallel_size(self) -> int:
        size = self.requested_tensor_parallel_size
        if size is None:  # the processes of this node (every node must have as many)
            nodes = self.all_gather_object(self.cluster_environment.node_rank)
            per_node = {node: nodes.count(node) for node in nodes}
            if len(set(per_node.values())) != 1:
                raise ValueError(
                    f"tensor_parallel_size=None takes the processes of one node, but the nodes run different numbers of "
                    f"processes ({per_node}); set tensor_parallel_size to a divisor of the world size {self.world_size}"
                )
            size = per_node[self.cluster_environment.node_rank]
            if self.pipelined:  # a stage's share of the node's processes (pp is outermost)
                size = max(1, size // self.pipeline_parallel_size)
        if self.world_size % size:
            divisors = [n for n in range(1, self.world_size + 1) if self.world_size % n == 0]
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the world size {self.world_size}; allowed: one of "
                f"{divisors} (the data-parallel size is world size / tensor_parallel_size)"
            )
        return size

    # -- the module ---------------------------------------------------------------------
    def check_module(self, module: torch.nn.Module) -> None:
        """Refuse a module with neither ``tensor_parallel_plan()`` nor its own ``parallelize(tp_mesh)``.

        Raises:
            ValueError: naming both methods.
            TypeError: the plan is not a dict of names to ``ParallelStyle``.
        """
        if custom_parallelize(module):
            return
        if not tensor_parallel_plan(module):
            raise ValueError(
                f"backend {self.name!r} splits the module's layers over tensor-parallel ranks, but "
                f"{type(module).__name__} defines neither tensor_parallel_plan() (a dict of submodule names to "
                "ParallelStyle, e.g. {'mlp.up': ColwiseParallel(), 'mlp.down': RowwiseParallel()}) nor "
                "parallelize(tp_mesh); define one of them, or use a data-parallel backend (ddp, fsdp)"
                + transformers_plan_hint(module)
            )

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Split the user's module over ``tp`` (plan or ``parallelize``), then shard over ``dp``
        (``module``: the step runner)."""
        target = getattr(module, "module", module)
        if self.pipelined:  # cut to this rank's stage, then split over tp and shard over dp
            self.check_module(target)
            return self.wrap_pipeline(module, split=self._split_stage)
        self.build_model(module)  # on meta: the layers it builds take no memory until split and sharded
        self.check_module(target)
        broadcast_from_rank_zero(target)  # the tensor-parallel split and the dp shards start from rank zero's weights
        if self.device_mesh is not None and self.tensor_parallel_size > 1:
            self.split_over_tensor_parallel(target, self.device_mesh["tp"])  # meta-built layers: split still on meta
            self.loss_parallel = bool(getattr(target, LOSS_PARALLEL_ATTRIBUTE, False))
        wrapped = super().wrap_module(module)  # shards over dp, then allocates and initializes each rank's meta parts
        if self.loss_parallel:  # the loss a step returns is a DTensor: the loop gets it whole, the backward still reaches it
            wrapped.register_forward_hook(self._loss_for_the_loop)
        return wrapped

    def _loss_for_the_loop(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> Any:
        if self._loss_parallel_open:  # a nested `with loss_parallel():` of the step's own is harmless
            _reopen_loss_parallel()
        return map_tensors(outputs, _whole)

    def _split_stage(self, target: torch.nn.Module) -> None:
        if self.device_mesh is not None and self.tensor_parallel_size > 1:
            self.split_over_tensor_parallel(target, self.device_mesh["tp"])

    def split_over_tensor_parallel(self, target: torch.nn.Module, tp_mesh: Any) -> None:
        """Split ``target``'s layers over ``tp_mesh`` by its ``parallelize(tp_mesh)`` or its plan,
        keeping tied parameters one DTensor (see :func:`retie`)."""
        ties = tied_parameters(target)
        if custom_parallelize(target):
            target.parallelize(tp_mesh)  # type: ignore[operator]
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(target, tp_mesh, tensor_parallel_plan(target))
        retie(target, ties)  # the styles replace each site's parameter on its own: one DTensor again

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        """FSDP's context for one micro-batch, inside ``loss_parallel()`` when the module sets
        ``uses_loss_parallel = True`` (its forward and backward both run in it, as torchtitan's
        train context does)."""
        return self._within_loss_parallel(super().no_sync(wrapped, skip_gradient_sync))

    def inference(self, module: torch.nn.Module) -> ContextManager:
        """FSDP's evaluation context, inside ``loss_parallel()`` as :meth:`no_sync` (a val_step's loss
        on vocabulary-sharded logits)."""
        return self._within_loss_parallel(super().inference(module))

    def _within_loss_parallel(self, context: ContextManager) -> ContextManager:
        if not self.loss_parallel:
            return context
        return self._inside_loss_parallel(context)

    @contextlib.contextmanager
    def _inside_loss_parallel(self, context: ContextManager) -> Any:
        from torch.distributed.tensor.parallel import loss_parallel

        with context, loss_parallel():
            self._loss_parallel_open = True
            try:
                yield
            finally:
                self._loss_parallel_open = False

    def explain_failure(self, error: BaseException) -> Optional[str]:
        """Also: a loss computed under ``loss_parallel()`` whose backward ran outside it (the module's
        own ``with loss_parallel():`` in ``train_step``) names ``uses_loss_parallel``."""
        if "got mixed torch.Tensor and DTensor" in str(error):
            return (
                f"a loss on vocabulary-sharded logits ran outside loss_parallel() under {self.name} (a val_step's "
                "forward, or the backward after a train_step's own `with loss_parallel():`): "
                f"set {LOSS_PARALLEL_ATTRIBUTE} = True on the module (a class attribute); the strategy then keeps "
                "loss_parallel() open around each micro-batch's forward and backward and around evaluation (as "
                "torchtitan's train context), and your own `with loss_parallel():` in train_step/val_step may stay "
                "or go. PyTorch said: " + str(error).strip().splitlines()[0][:300]
            )
        return super().explain_failure(error)

    def sharding_mesh(self, module: torch.nn.Module) -> Any:
        """The ``dp`` axis of the mesh, or ``("dp_replicate", "dp_shard")`` under HSDP (None with one
        data-parallel rank: nothing to shard)."""
        if self.device_mesh is None or self.data_parallel_size == 1:
            return None
        return self.device_mesh[HSDP_DIM_NAMES] if self.data_parallel_replicate_size > 1 else self.device_mesh[DATA_DIM]

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduced over the ranks of this rank's ``dp`` axis (one per share of the data)."""
        if self.device_mesh is None or (self.tensor_parallel_size == 1 and not self.pipelined):
            return self.all_reduce(tensor, op)
        return reduce_over(tensor, op, self.data_parallel_size, self.device_mesh.get_group("dp"))

    def teardown(self) -> None:
        self.device_mesh = None
        self.loss_parallel = False
        super().teardown()


def transformers_plan_hint(module: torch.nn.Module) -> str:
    """A sentence for the refusal of a module without a plan when it holds a ``transformers`` model:
    such models carry ``config.base_model_tp_plan`` (their base model's split, as strings), and where
    that base model sits; "" otherwise.

    Example:
        >>> transformers_plan_hint(torch.nn.Linear(2, 2))
        ''
    """
    for name, child in module.named_modules():
        plan = getattr(getattr(child, "config", None), "base_model_tp_plan", None)
        base = getattr(child, "base_model", None)
        if not plan or not isinstance(base, torch.nn.Module):
            continue
        prefix = next((f"{inner}." for inner, sub in module.named_modules() if sub is base and inner), "")
        example = ", ".join(f"{key!r}: {value!r}" for key, value in list(plan.items())[:2])
        return (
            f". {name or type(module).__name__} is a transformers model: its config.base_model_tp_plan "
            f"({{{example}, ...}}) is its base model's split; tensor_parallel_plan() can return it with each "
            f"name prefixed by {prefix!r} and 'colwise'/'rowwise' as ColwiseParallel()/RowwiseParallel() "
            "(a '*' expanded to each layer's index)"
        )
    return ""
