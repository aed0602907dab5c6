"""TrainerArguments: every knob of a training run, checked when it is built."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from framework.checkpoint.arguments import DefaultCheckpointerArguments
from framework.config.typed_fields import check_field_types
from framework.lifecycle.preemption import parse_signals
from framework.loggers.base import Logger
from framework.loggers.registry import check_logger_choices

PROFILERS = ("off", "throughput", "torch")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _CarriesRunConfig:
    """Keeps the config :func:`~framework.parse_config` built the arguments in, in a slot: outside
    the instance ``__dict__`` and the dataclass fields, so ``vars(args)``, ``==``, ``repr`` and
    ``dataclasses.asdict`` see the settings only (``TrainerArguments(**vars(args))`` copies them)."""

    __slots__ = ("_run_config",)

    @property
    def run_config(self) -> Optional[Any]:  # a RunConfig (not imported: framework.config.cli imports this file)
        """The :class:`~framework.config.cli.RunConfig` that :func:`~framework.parse_config` built these
        arguments in (set by it; the trainer saves its every section, yours included, to
        ``config.yaml``); None for arguments built in code or copied."""
        return getattr(self, "_run_config", None)  # a slot is unset until parse_config sets it

    @run_config.setter
    def run_config(self, config: Optional[Any]) -> None:
        self._run_config = config


@dataclass
class TrainerArguments(_CarriesRunConfig):
    """Arguments of a :class:`~framework.Trainer` run.

    Batch sizes: ``train_batch_size`` is the global batch per optimizer step. Each of the
    ``world_size`` processes gets ``train_batch_size / world_size`` samples per step, split
    into micro-batches of at most ``gpu_batch_size_limit``; gradient accumulation covers
    the rest.

    Example:
        >>> args = TrainerArguments(epochs=3, train_batch_size=64, gpu_batch_size_limit=16)
        >>> args.backend
        'sp'
    """

    epochs: int = 1
    """Maximum number of epochs."""
    min_epochs: int = 0
    """Epochs to run before a stop request (early stopping) is honoured."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in total."""
    max_time: Optional[float] = None
    """Stop after this many seconds of wall-clock training (checked every optimizer step)."""
    train_batch_size: int = 32
    """Global batch size per optimizer step, summed over processes and micro-batches."""
    gpu_batch_size_limit: Optional[Union[int, str]] = None
    """Largest micro-batch per process; must divide the per-process batch. ``"auto"``: the largest that fits
    in device memory, found before training (probing forward and backward, halving on ``torch.OutOfMemoryError``)
    and kept in checkpoints; gradient accumulation makes up the rest of the batch."""
    val_batch_size: Optional[int] = None
    """Evaluation batch per process (None: the training micro-batch)."""
    max_train_steps_per_epoch: Optional[Union[int, float]] = None
    """Optimizer steps per epoch: an int, or a float in (0, 1] as a fraction of the loader."""
    max_val_steps_per_epoch: Optional[Union[int, float]] = None
    """Evaluation batches per loader: an int, or a float in (0, 1] as a fraction."""
    val_every_n_epochs: int = 1
    """Validate after every N epochs (0: never at epoch ends)."""
    val_every_n_steps: Optional[int] = None
    """Also validate every N optimizer steps, mid-epoch."""
    sanity_val_steps: int = 2
    """Run this many batches of each validation loader before training starts (Lightning's
    ``num_sanity_val_steps``): the whole validation loop, hooks included, with
    ``trainer.sanity_checking`` true, recording nothing and restoring the random state; 0 turns it off.
    Only in a run that starts at step 0 (not on resume) and not under ``fast_dev_run``."""
    fast_dev_run: bool = False
    """One train and one validation batch through every hook; no checkpoints or files."""
    clip_grads: bool = False
    """Clip the total gradient norm to ``max_grad_norm``."""
    max_grad_norm: float = 1.0
    """Norm used when ``clip_grads`` is on."""
    clip_grad_value: Optional[float] = None
    """Clip every gradient element to [-value, value]."""
    track_grad_norm: bool = False
    """Record the total gradient norm (before clipping) as the ``grad_norm`` metric."""
    scheduler_interval: str = "step"
    """Step bare schedulers per optimizer ``step`` or per ``epoch`` (a scheduler dict's ``interval`` wins)."""
    scheduler_monitor: str = "val_loss"
    """Metric fed to ``ReduceLROnPlateau`` schedulers (once per epoch; a scheduler dict's ``monitor`` wins)."""
    tbptt_steps: Optional[int] = None
    """Truncated backprop through time: split batches along dim 1 into chunks of this length."""
    collect_train_outputs: bool = False
    """Keep every train step's outputs for ``on_end_train_epoch`` (off: nothing is kept)."""
    backend: str = "sp"
    """Backend name: sp, sp-amp, sp-bf16, ddp, ddp-amp, ddp-bf16, fsdp, fsdp-amp, fsdp-bf16, model-parallel,
    model-parallel-amp, model-parallel-bf16, or a registered plugin."""
    amp_dtype: Optional[str] = None
    """Mixed precision dtype: float16 (CUDA, with GradScaler) or bfloat16; None: fp16 on CUDA, bf16 on CPU. Taken by the
    ``*-amp`` backends (``MixedPrecision(dtype=...)``) and, as ``bfloat16`` only, by ``*-bf16``; an fp32 backend refuses a
    value."""
    find_unused_parameters: bool = False
    """Passed to DistributedDataParallel: ``DDP(find_unused_parameters=...)``. Only the ddp backends take it; any other backend
    refuses ``True`` with a ``ValueError``."""
    ddp_timeout: float = 600.0
    """Seconds a collective waits for a missing rank before the job fails (accepted, and unused, by single-process backends,
    which wait for no rank)."""
    reshard_after_forward: bool = True
    """fsdp backends: free each unit's gathered parameters after its forward (less memory, one more all-gather in backward);
    ``False`` keeps them until backward. Passed to ``FSDP(reshard_after_forward=...)``; any other backend refuses ``False``."""
    tensor_parallel_size: Optional[int] = None
    """model-parallel backends: ranks that split each layer (the ``tp`` axis of the ``("dp", "tp")`` mesh); must
    divide the world size, the data-parallel size is world size / this. None: the processes of one node.
    Any other backend refuses a value (see docs/model-parallel.md)."""
    data_parallel_replicate_size: Optional[int] = None
    """HSDP on the fsdp and model-parallel backends: the data-parallel ranks form this many replica groups; parameters are
    sharded within a group and gradients all-reduced across groups (a ``("dp_replicate", "dp_shard")`` mesh,
    ``("dp_replicate", "dp_shard", "tp")`` under model-parallel). Usually the number of nodes. Must divide the data-parallel
    size. ``None``: 1 (shard over every data-parallel rank). Passed to ``FSDP(data_parallel_replicate_size=...)`` /
    ``ModelParallel(data_parallel_replicate_size=...)``; any other backend refuses a value. See
    [distributed.md](distributed.md#hsdp-replicate-across-nodes-shard-within-one)."""
    pipeline_parallel_size: int = 1
    """fsdp and model-parallel backends: pipeline stages (the ``pp`` axis, outermost: ``("pp", "dp_replicate", "dp_shard",
    "tp")``); each stage holds a contiguous part of the model (by default the blocks of its first ``nn.ModuleDict`` /
    ``nn.ModuleList`` split evenly) and its ranks read the same batches. Must divide the world size; the data-parallel size
    is world size / (this x tensor_parallel_size). The module defines ``pipeline_inputs(batch)`` and
    ``pipeline_loss(outputs, target)``. 1: no pipeline. Any other backend refuses a value (see pipeline-parallel.md)."""
    pipeline_schedule: str = "1F1B"
    """With ``pipeline_parallel_size > 1``: torch's schedule that runs each step's micro-batches (the accumulation cycle)
    through the stages: ``"1F1B"`` (one forward, one backward: activations of at most ``pipeline_parallel_size``
    micro-batches in memory) or ``"GPipe"`` (every forward, then every backward); case-insensitive. Interleaved and V
    schedules (several stages per rank) are refused by name."""
    backend_options: Dict[str, Any] = field(default_factory=dict)
    """The chosen backend's own options, as a plugin declares them (``register_backend(..., options=...)``); the factory
    receives each as a keyword argument. ``--trainer.backend_options.NAME VALUE``, or ``backend_options: {NAME: VALUE}``
    under ``trainer:`` in YAML. A name the backend does not declare is refused with the closest declared one; ``--help``
    lists them under the backends that declare them. See [backends.md](backends.md#a-plugins-own-options)."""
    cluster: Optional[str] = None
    """Cluster environment (``torchrun``, ``slurm``, ``mpi``, ``local``, or a registered plugin); None: detect it. See
    [distributed.md](distributed.md#clusters)."""
    compile: bool = False
    """Compile the model for training with ``torch.compile`` (each sharding unit, or each child module); see
    docs/distributed.md."""
    activation_checkpointing: bool = False
    """Recompute each sharding unit's activations in backward instead of keeping them (less memory, about one more forward);
    applied before compile and FSDP sharding, on every backend. Needs units: ``sharding_units()`` or ``nn.ModuleList`` /
    ``nn.ModuleDict`` blocks. See [distributed.md](distributed.md#activation-checkpointing)."""
    profiler: str = "off"
    """``"throughput"``: record ``samples_per_second``, ``steps_per_second``, ``mfu`` and ``peak_memory_gib`` at each log point
    (a ``Throughput`` callback); ``"torch"``: that plus ``torch.profiler`` traces of a few steps under
    ``<output_dir>/profiler/`` (a ``TorchProfiler`` callback); ``"off"``: neither, nothing in the loop. See
    [callbacks.md](callbacks.md#profiling-and-throughput)."""
    use_gpu: Optional[bool] = None
    """None: a GPU when present; True: require one; False: CPU."""
    seed: int = 42
    """Seeds python, numpy and torch, and the shuffling order (0 to 2**32 - 1), when the ``Trainer`` is built; call
    ``framework.seed_everything(seed)`` before building your module to repeat its initial weights too."""
    log_every_n_steps: int = 50
    """Read losses back from the device and write them every N optimizer steps."""
    disable_tqdm: bool = False
    """Hide progress bars (and the plain progress lines written when stderr is not a terminal)."""
    model_summary: bool = True
    """Log the model's parameter counts per top-level child when training starts (rank zero, INFO)."""
    log_level: str = "INFO"
    """Level of the framework's log messages on rank zero."""
    output_dir: str = "outputs"
    """Where metrics.csv, config.yaml and (by default) checkpoints go."""
    output_dir_in_use: str = "new_version"
    """When ``output_dir`` holds another run that this run does not resume: ``"new_version"`` trains in
    ``<output_dir>/version_<N>`` (the first free N >= 1, said once in the log); ``"error"`` refuses to start
    (``RunDirectoryInUse``)."""
    loggers: List[Union[str, Logger]] = field(default_factory=lambda: ["csv"])
    """Where metrics go on rank zero: names (``csv``, ``tensorboard``, ``mlflow``, ``wandb``, or one from the
    ``framework.loggers`` entry points) or Logger instances; one alone may be given as it is (``loggers="csv"``);
    CLI ``--trainer.loggers '[csv,mlflow]'``."""
    plot_metrics: Optional[bool] = None
    """Draw ``<output_dir>/metrics.png`` from metrics.csv when training ends (losses on a log axis; a ``MetricsPlot`` callback);
    None: where matplotlib is installed, unless the environment sets ``FRAMEWORK_PLOT_METRICS=0`` (this repository's tests
    do)."""
    tensorboard: bool = False
    """Also write TensorBoard events to ``<output_dir>/tensorboard`` (the same as adding ``"tensorboard"`` to ``loggers``)."""
    preemption_signals: str = "SIGTERM,SIGINT,SIGUSR1"
    """Signals that stop training at the next step boundary with a checkpoint (exit code 75); "" catches none."""
    stop_on_nonfinite_loss: bool = True
    """Stop with an error naming the first step whose training loss was NaN/inf (checked where losses are
    read; not under an fp16 GradScaler, which skips those steps)."""
    checkpointer_args: DefaultCheckpointerArguments = field(default_factory=DefaultCheckpointerArguments)
    """Arguments of the default checkpointer."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpointer_args, dict):
            self.checkpointer_args = DefaultCheckpointerArguments(**self.checkpointer_args)
        if isinstance(self.loggers, (str, Logger)):  # loggers="csv": one logger, not the letters c, s, v
            self.loggers = [self.loggers]
        check_field_types(self, "TrainerArguments")  # types first: the range checks below compare numbers
        check_logger_choices(self.loggers)
        _require(self.epochs >= 1, "epochs", self.epochs, "an integer >= 1")
        _require(self.min_epochs >= 0, "min_epochs", self.min_epochs, "an integer >= 0")
        _require(self.train_batch_size >= 1, "train_batch_size", self.train_batch_size, "an integer >= 1")
        limit = self.gpu_batch_size_limit
        _require(
            limit in (None, "auto") or (isinstance(limit, int) and limit >= 1),
            "gpu_batch_size_limit",
            limit,
            "None, 'auto' or an integer >= 1",
        )
        for name in ("max_steps", "val_batch_size", "val_every_n_steps", "tbptt_steps"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, value, "None or an integer >= 1")
        for name in ("max_train_steps_per_epoch", "max_val_steps_per_epoch"):
            value = getattr(self, name)
            allowed = (
                value is None or (isinstance(value, int) and value >= 1) or (isinstance(value, float) and 0.0 < value <= 1.0)
            )
            _require(allowed, name, value, "None, an integer >= 1, or a fraction in (0, 1]")
        _require(self.max_time is None or self.max_time > 0, "max_time", self.max_time, "None or seconds > 0")
        _require(self.val_every_n_epochs >= 0, "val_every_n_epochs", self.val_every_n_epochs, "an integer >= 0")
        _require(self.sanity_val_steps >= 0, "sanity_val_steps", self.sanity_val_steps, "an integer >= 0")
        _require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "a number > 0")
        _require(self.clip_grad_value is None or self.clip_grad_value > 0, "clip_grad_value", self.clip_grad_value, "None or > 0")
        tp_size = self.tensor_parallel_size
        _require(
            tp_size is None or (isinstance(tp_size, int) and not isinstance(tp_size, bool) and tp_size >= 1),
            "tensor_parallel_size",
            tp_size,
            "None or an integer >= 1 that divides the world size",
        )
        replicas = self.data_parallel_replicate_size
        _require(
            replicas is None or (isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1),
            "data_parallel_replicate_size",
            replicas,
            "None or an integer >= 1 that divides the data-parallel size",
        )
        pp_size = self.pipeline_parallel_size
        _require(
            isinstance(pp_size, int) and not isinstance(pp_size, bool) and pp_size >= 1,
            "pipeline_parallel_size",
            pp_size,
            "an integer >= 1 that divides the world size (1: no pipeline)",
        )
        _require(
            isinstance(self.pipeline_schedule, str) and self.pipeline_schedule.lower() in PIPELINE_SCHEDULES,
            "pipeline_schedule",
            self.pipeline_schedule,
            "'1F1B' or 'GPipe' (interleaved and V schedules need several stages per rank, not built yet)",
        )
        _require(self.scheduler_interval in ("step", "epoch"), "scheduler_interval", self.scheduler_interval, "'step' or 'epoch'")
        _require(self.amp_dtype in (None, "float16", "bfloat16"), "amp_dtype", self.amp_dtype, "None, 'float16' or 'bfloat16'")
        in_use = self.output_dir_in_use
        _require(in_use in OUTPUT_DIR_IN_USE, "output_dir_in_use", in_use, f"one of {OUTPUT_DIR_IN_USE}")
        _require(self.profiler in PROFILERS, "profiler", self.profiler, f"one of {PROFILERS}")
        _require(0 <= self.seed < 2**32, "seed", self.seed, "an integer from 0 to 2**32 - 1 (numpy's seed range)")
        _require(self.log_every_n_steps >= 1, "log_every_n_steps", self.log_every_n_steps, "an integer >= 1")
        _require(self.ddp_timeout > 0, "ddp_timeout", self.ddp_timeout, "seconds > 0")
        _require(isinstance(self.reshard_after_forward, bool), "reshard_after_forward", self.reshard_after_forward, "True, False")
        _require(str(self.log_level).upper() in _LOG_LEVELS, "log_level", self.log_level, f"one of {_LOG_LEVELS}")
        _require(isinstance(self.backend, str) and bool(self.backend), "backend", self.backend, "a backend name")
        options = self.backend_options
        _require(isinstance(options, dict) and all(isinstance(k, str) for k in options), "backend_options", options, "a dict")
        parse_signals(self.preemption_signals)  # an unknown name is an error naming it and the allowed ones
        _require(
            self.cluster is None or (isinstance(self.cluster, str) and bool(self.cluster)),
            "cluster",
            self.cluster,
            "None (detect) or a cluster environment name such as 'slurm'",
        )


OUTPUT_DIR_IN_USE = ("new_version", "error")


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"TrainerArguments.{name}={value!r} is invalid; allowed: {allowed}")


def micro_batch_plan(
    train_batch_size: int, world_size: int, gpu_batch_size_limit: Optional[Union[int, str]]
) -> "tuple[int, int]":
    """Split the global batch into ``(micro_batch_size, gradient_accumulation)`` per process
    (``"auto"`` before its search: the whole per-process batch). ``world_size`` is the data-parallel
    size (the processes that split the batch; under model-parallel, world size / tensor_parallel_size).

    Raises:
        ValueError: the batch does not split evenly over processes or micro-batches.

    Example:
        >>> micro_batch_plan(32, world_size=2, gpu_batch_size_limit=8)
        (8, 2)
    """
    if train_batch_size % world_size:
        raise ValueError(
            f"train_batch_size={train_batch_size} is not divisible by the data-parallel size {world_size} (the processes "
            f"that each take a share of the batch); use a multiple of {world_size}"
        )
    per_process = train_batch_size // world_size
    if not isinstance(gpu_batch_size_limit, int) or gpu_batch_size_limit >= per_process:
        return per_process, 1
    if per_process % gpu_batch_size_limit:
        divisors = [d for d in range(gpu_batch_size_limit, 0, -1) if per_process % d == 0][:3]
        raise ValueError(
            f"train_batch_size={train_batch_size} gives {per_process} samples per data-parallel rank (data-parallel "
            f"size {world_size}), which gpu_batch_size_limit={gpu_batch_size_limit} does not divide into equal "
            f"micro-batches; use a limit that divides {per_process}, e.g. {', '.join(map(str, divisors))}"
        )
    return gpu_batch_size_limit, per_process // gpu_batch_size_limit
