"""Pipeline parallelism: ``pp``, the outermost dimension of the fsdp and model-parallel meshes.

The ranks form ``pipeline_parallel_size`` consecutive blocks of ``world_size / pp`` ranks (torchtitan's
order ``pp, dp_replicate, dp_shard, tp``): block ``s`` holds stage ``s`` of the model (cut with
:func:`~backends.strategies.pipeline_stages.keep_stage`), and inside a block the ranks are the
data-parallel (and tensor-parallel) layout the strategy has without a pipeline. Rank ``r`` runs stage
``r // (world / pp)``; its peers in the other stages (same place in their block) form its pipeline
group, read the same batches, and pass activations and gradients through
:class:`~backends.strategies.pipeline_schedule.PipelineRunner`. The data-parallel rank and size
exclude ``pp``; the last stage's ranks speak for the data (:meth:`data_parallel_representatives`),
because the loss exists there only.

How to use (``torchrun --nproc_per_node=4``: pp 2 x dp 2; the module defines ``pipeline_inputs`` and
``pipeline_loss``, and its ``forward`` runs the parts a stage holds)::

    class Llama(ModuleInterface):
        def pipeline_inputs(self, batch):              # (the first stage's inputs, the last stage's target)
            tokens = batch[0]
            return (tokens[:, :-1],), tokens[:, 1:]
        def pipeline_loss(self, logits, target):       # one micro-batch's loss, on the last stage
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    args = TrainerArguments(backend="fsdp", pipeline_parallel_size=2, pipeline_schedule="1F1B",
                            train_batch_size=32, gpu_batch_size_limit=4)  # 4 micro-batches per step
    Trainer(Llama(), args).train()

The mixin is placed before :class:`~backends.strategies.ddp.DDP` in FSDP's bases; with
``pipeline_parallel_size == 1`` every method is the strategy's own.
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from backends.strategies.ddp import reduce_over
from backends.strategies.hsdp import DATA_DIM, HSDP_DIM_NAMES, REPLICATE_DIM, SHARD_DIM, TENSOR_DIM
from backends.strategies.pipeline_init import materialize_stage, meta_built
from backends.strategies.pipeline_schedule import DEFAULT_SCHEDULE, PipelineRunner, schedule_class
from backends.strategies.pipeline_stages import check_stages, default_stages, keep_stage
from backends.strategies.units import module_units, shard_groups

logger = logging.getLogger(__name__)

PIPELINE_DIM, STAGE_DIM = "pp", "stage"
MESH_DIM_NAMES = (PIPELINE_DIM, REPLICATE_DIM, SHARD_DIM, TENSOR_DIM)
"""torchtitan's order; ``"dp"`` flattens the two data-parallel dimensions, ``"stage"`` every dimension but ``pp``."""


def checked_pipeline_size(value: Any) -> int:
    """``value`` when it is a valid ``pipeline_parallel_size`` (an integer >= 1).

    Raises:
        ValueError: naming the value and what is allowed.

    Example:
        >>> checked_pipeline_size(2)
        2
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"pipeline_parallel_size={value!r} is invalid; allowed: an integer >= 1 that divides the world size (1: no pipeline)"
        )
    return value


class StageModule(torch.nn.Module):
    """The module a pipeline stage runs: ``forward(*inputs)`` is the user's module's ``forward`` (which runs
    the parts this stage holds); the root unit FSDP2 shards and the schedule calls."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: Any) -> Any:
        return self.module(*inputs)


class PipelineParallel:
    """What a strategy does differently with ``pipeline_parallel_size > 1`` (a mixin of FSDP and ModelParallel).

    Args:
        pipeline_parallel_size: stages (``TrainerArguments.pipeline_parallel_size``); must divide the world size.
        pipeline_schedule: torch's schedule name (``TrainerArguments.pipeline_schedule``): ``"1F1B"`` or ``"GPipe"``.

    Example:
        >>> from backends.strategies.fsdp import FSDP
        >>> strategy = FSDP(use_gpu=False, pipeline_parallel_size=2, pipeline_schedule="GPipe")
        >>> strategy.options["pipeline_parallel_size"], strategy.options["pipeline_schedule"]
        (2, 'GPipe')
    """

    rank: int
    world_size: int
    device: torch.device
    data_parallel_replicate_size: int

    def __init__(
        self, *args: Any, pipeline_parallel_size: int = 1, pipeline_schedule: str = DEFAULT_SCHEDULE, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline_parallel_size = checked_pipeline_size(pipeline_parallel_size)
        schedule_class(pipeline_schedule)  # an unknown or several-stages-per-rank schedule: refused by name now
        self.pipeline_schedule = pipeline_schedule
        self.pipeline_mesh: Any = None
        self.stage_module: Optional[torch.nn.Module] = None
        self._runners: Dict[Any, PipelineRunner] = {}

    @property
    def pipeline_options(self) -> Dict[str, Any]:
        return {"pipeline_parallel_size": self.pipeline_parallel_size, "pipeline_schedule": self.pipeline_schedule}

    @property
    def pipelined(self) -> bool:
        """True with more than one stage."""
        return self.pipeline_parallel_size > 1

    # -- the layout -----------------------------------------------------------------------
    @property
    def ranks_per_stage(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def pipeline_rank(self) -> int:
        """The stage this rank runs (0: the first)."""
        return self.rank // self.ranks_per_stage if self.pipelined else 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_parallel_size - 1

    @property
    def data_parallel_rank(self) -> int:
        return self.rank % self.ranks_per_stage if self.pipelined else super().data_parallel_rank  # type: ignore[misc]

    @property
    def data_parallel_size(self) -> int:
        return self.ranks_per_stage if self.pipelined else super().data_parallel_size  # type: ignore[misc]

    def data_parallel_representatives(self) -> List[int]:
        """The last stage's ranks (where the loss is), one per data-parallel rank."""
        if not self.pipelined:
            return super().data_parallel_representatives()  # type: ignore[misc]
        return [(self.pipeline_parallel_size - 1) * self.ranks_per_stage + rank for rank in range(self.ranks_per_stage)]

    def data_parallel_all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Over the ranks of this stage that read distinct data (``"dp"``)."""
        if not self.pipelined or self.pipeline_mesh is None:
            return super().data_parallel_all_reduce(tensor, op)  # type: ignore[misc]
        return reduce_over(tensor, op, self.data_parallel_size, self.pipeline_mesh.get_group(DATA_DIM))

    def pipeline_group(self) -> Optional[Any]:
        """This rank's pipeline peers (one rank per stage, in stage order); None without a pipeline."""
        if not self.pipelined or self.pipeline_mesh is None:
            return None
        return self.pipeline_mesh.get_group(PIPELINE_DIM)

    def check_pipeline_layout(self, tensor_parallel_size: int = 1) -> None:
        """Refuse a pipeline size that does not divide the world size (with ``tensor_parallel_size``).

        Raises:
            ValueError: naming the sizes and those allowed.
        """
        if self.world_size % (self.pipeline_parallel_size * tensor_parallel_size):
            divisors = [n for n in range(1, self.world_size + 1) if self.world_size % (n * tensor_parallel_size) == 0]
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} does not divide the world size {self.world_size}"
                f"{f' / tensor_parallel_size {tensor_parallel_size}' if tensor_parallel_size > 1 else ''}; allowed: one of "
                f"{divisors} (the data-parallel size is world size / (pipeline_parallel_size x tensor_parallel_size))"
            )

    def build_pipeline_mesh(self, tensor_parallel_size: int = 1) -> Any:
        """The ``("pp", "dp_replicate", "dp_shard", "tp")`` mesh (collective), with ``"dp"`` and ``"stage"`` flattened."""
        from torch.distributed.device_mesh import init_device_mesh

        self.check_pipeline_layout(tensor_parallel_size)
        replicas = self.data_parallel_replicate_size
        shard = self.world_size // (self.pipeline_parallel_size * tensor_parallel_size * replicas)
        shape = (self.pipeline_parallel_size, replicas, shard, tensor_parallel_size)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=MESH_DIM_NAMES)
        mesh[HSDP_DIM_NAMES]._flatten(DATA_DIM)  # torch has no public call for a flattened dimension
        mesh[(*HSDP_DIM_NAMES, TENSOR_DIM)]._flatten(STAGE_DIM)
        self.pipeline_mesh = mesh
        return mesh

    def pipeline_sharding_mesh(self) -> Any:
        """What FSDP2 shards a stage over: ``dp_shard`` (``(dp_replicate, dp_shard)`` under HSDP); None with one rank."""
        if self.pipeline_mesh is None or self.data_parallel_size == 1:
            return None
        return self.pipeline_mesh[HSDP_DIM_NAMES] if self.data_parallel_replicate_size > 1 else self.pipeline_mesh[SHARD_DIM]

    # -- the stage --------------------------------------------------------------------------
    def stage_names(self, module: torch.nn.Module) -> List[List[str]]:
        """Each stage's top-level names: the module's ``pipeline_stages(num_stages)``, else the default split."""
        method = getattr(module, "pipeline_stages", None)
        stages = method(self.pipeline_parallel_size) if callable(method) else None
        if stages is None:
            return default_stages(module, self.pipeline_parallel_size)
        stages = [list(stage) for stage in stages]
        check_stages(module, stages, self.pipeline_parallel_size)
        return stages

    def wrap_pipeline(
        self, module: torch.nn.Module, split: Optional[Callable[[torch.nn.Module], None]] = None
    ) -> torch.nn.Module:
        """Cut the user's module down to this rank's stage, ``split`` it (tensor parallelism), shard it over
        the stage's data-parallel ranks and allocate what it holds (``module``: the step runner, returned)."""
        target = getattr(module, "module", module)
        self.build_model(module)  # type: ignore[attr-defined]  # on meta: nothing allocated for the other stages
        stages = self.stage_names(target)
        order = meta_built(target)  # the whole model's draw order: each stage starts from sp's values
        self._broadcast_from_rank_zero(target)  # before the cut: every stage starts from rank zero's weights
        keep_stage(target, stages[self.pipeline_rank])
        logger.debug("rank %d: pipeline stage %d holds %s", self.rank, self.pipeline_rank, stages[self.pipeline_rank])
        if split is not None:
            split(target)
        stage = StageModule(target)
        mesh = self.pipeline_sharding_mesh()
        if mesh is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            param_dtype = getattr(self, "param_dtype", None)
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
            reshard = getattr(self, "reshard_after_forward", True)
            for group in shard_groups(module_units(target)):
                fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
            fully_shard(stage, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        materialize_stage(target, self.device, order)
        self.compile_units(target, module_units(target))  # type: ignore[attr-defined]  # compile=True: after sharding
        self.stage_module = stage
        self._runners = {}
        return module

    def _broadcast_from_rank_zero(self, module: torch.nn.Module) -> None:
        """Every rank starts from rank zero's weights, as DDP and FSDP do: called on the whole model before the
        cut, so stage ``s`` gets the values rank zero built for its parts, not its own rank's (tensors built
        normally; meta ones are drawn alike from the run's seed by :func:`materialize_stage`)."""
        if self.pipeline_mesh is None:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not tensor.is_meta:
                    data = torch.view_as_real(tensor.data) if tensor.is_complex() else tensor.data
                    dist.broadcast(data, src=0)

    def pipeline_runner(
        self, micro_batches: int, loss: Callable[[Any, Any], torch.Tensor], inputs: Sequence[Any] = ()
    ) -> PipelineRunner:
        """The schedule over ``micro_batches`` micro-batches for this rank's stage, built once per count and
        shape of ``inputs`` (a stage infers the shapes it sends and receives once: a smaller last batch gets its own)."""
        if self.stage_module is None:
            raise RuntimeError("pipeline_runner() before wrap_module(): the stage is cut when the module is wrapped")
        key = (micro_batches, tuple(tuple(getattr(tensor, "shape", ())) for tensor in inputs))
        runner = self._runners.get(key)
        if runner is None:
            # 1F1B needs a micro-batch per stage; with fewer (a short cycle) GPipe computes the same gradients
            schedule = self.pipeline_schedule if micro_batches >= self.pipeline_parallel_size else "GPipe"
            runner = PipelineRunner(
                self.stage_module,
                self.pipeline_rank,
                self.pipeline_parallel_size,
                self.device,
                self.pipeline_group(),
                schedule,
                micro_batches,
                loss,
            )
            self._runners[key] = runner
        runner.loss = loss
        return runner

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the last stage holds it, on every stage (collective over the pipeline group; in place)."""
        dist.broadcast(tensor, group=self.pipeline_group(), group_src=self.pipeline_parallel_size - 1)
        return tensor

    def every_stage(self, state: Any) -> Any:
        """Under a pipeline, every stage's entries of a ``state_dict`` of full tensors (collective over the
        pipeline group; what ``unsharded`` returns), nested dictionaries (``get_state()``'s ``"model"``)
        merged too: exports hold the whole model. This rank's own entries keep their values."""
        if not self.pipelined or not isinstance(state, dict) or self.pipeline_group() is None:
            return state
        stages: List[Any] = [None] * self.pipeline_parallel_size
        dist.all_gather_object(stages, state, group=self.pipeline_group())
        return merged_stages(state, stages)

    def from_last_stage(self, obj: Any) -> Any:
        """The last stage's ``obj`` on every stage (collective over the pipeline group): what ``pipeline_loss``
        logged there reaches rank zero's loggers."""
        objects = [obj]
        dist.broadcast_object_list(objects, group=self.pipeline_group(), group_src=self.pipeline_parallel_size - 1)
        return objects[0]

    def teardown(self) -> None:
        self.pipeline_mesh, self.stage_module, self._runners = None, None, {}
        super().teardown()  # type: ignore[misc]


def merged_stages(own: Any, stages: Sequence[Any]) -> Any:
    """``own`` with the entries of every stage's dictionary it lacks, in stage order, nested dictionaries merged.

    Example:
        >>> merged_stages({"model": {"b": 2}, "step": 1}, [{"model": {"a": 1}, "step": 0}, {"model": {"b": 2}, "step": 1}])
        {'model': {'a': 1, 'b': 2}, 'step': 1}
    """
    if not isinstance(own, dict):
        return own
    dictionaries = [stage for stage in stages if isinstance(stage, dict)]
    merged: Dict[Any, Any] = {}
    for stage in dictionaries:
        for key in stage:
            if key not in merged:
                values = [other[key] for other in dictionaries if key in other]
                mine = own.get(key, values[0])
                merged[key] = merged_stages(mine, values) if isinstance(mine, dict) else mine
    for key, value in own.items():
        merged.setdefault(key, value)
    return type(own)(merged) if type(own) is not dict else merged
