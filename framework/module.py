"""ModuleInterface: what a user implements, and the dispatcher that DDP wraps."""

import abc
import inspect
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch.utils.data import DataLoader

from backends.strategies.model_parallel import DEFAULT_PARALLELIZE_MARK
from framework.config import hyperparameters
from framework.config.hyperparameters import HYPER_PARAMETERS_KEY, AttributeDict
from framework.data.data_module import DataModule, data_module_loader
from framework.loop.hooks import TrainingHooks
from framework.loop.manual_optimization import ManualOptimization, one_or_list
from framework.loop.stage import Stage

if TYPE_CHECKING:
    from framework.loop.view import TrainerView
    from framework.metrics.collector import MetricCollector

Loaders = Union[None, DataLoader, Dict[str, DataLoader]]


class ModuleInterface(torch.nn.Module, TrainingHooks, abc.ABC):
    """The model plus everything the trainer needs to train it.

    Implement the three abstract methods; add ``get_val_dataloaders`` and ``val_step`` for
    validation and ``get_test_dataloaders``/``test_step`` for testing. Batches reach the
    step methods already on ``device``. Hooks (``on_*``) are optional and receive the same
    arguments as the matching :class:`~framework.callbacks.Callback` hooks.

    Example:
        >>> import torch.nn.functional as F
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Regression(ModuleInterface):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Linear(3, 1)
        ...         self.data = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
        ...     def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        ...         return [torch.optim.SGD(self.parameters(), lr=0.1)], []
        ...     def get_train_dataloader(self, sampler, batch_size):
        ...         return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))
        ...     def train_step(self, global_step, batch, device):
        ...         x, y = batch
        ...         return F.mse_loss(self.net(x), y)

    Manual optimization (a GAN, several updates per batch, per-chunk TBPTT): set
    ``automatic_optimization = False`` and step inside ``train_step`` with
    :meth:`optimizers`, :meth:`manual_backward`, :meth:`clip_gradients` and
    :meth:`lr_schedulers` (see ``docs/manual-optimization.md``).
    """

    automatic_optimization: bool = True
    """False: ``train_step`` runs its own backward passes and optimizer steps."""

    datamodule: Optional[DataModule] = None
    """The :class:`~framework.DataModule` the trainer was given (``datamodule=``), or None."""

    max_grad_norm: Optional[float] = None
    """The module's own gradient-norm clipping under automatic optimization (None: none), used
    when ``TrainerArguments.clip_grads`` is off (on, ``TrainerArguments.max_grad_norm`` wins):
    :class:`~framework.integrations.transformers.PretrainedModule` sets 1.0, the transformers
    ``Trainer``'s default."""

    # -- required ---------------------------------------------------------------------
    @abc.abstractmethod
    def get_optimizers_schedulers(
        self, estimated_global_steps_per_epoch: int, epochs: int
    ) -> Tuple[Sequence[torch.optim.Optimizer], Sequence[Any]]:
        """Return ``(optimizers, schedulers)``; schedulers step once per optimizer step by default."""

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        """Return the training loader; build its sampler with ``sampler(dataset)``. Required unless
        the trainer was given a :class:`~framework.DataModule` (``datamodule=``), whose loader it is then."""
        if self.datamodule is None:
            raise NotImplementedError(
                f"{type(self).__name__} defines no get_train_dataloader(sampler, batch_size) and the Trainer was "
                "given no datamodule=; define one of them"
            )
        return data_module_loader(self.datamodule, "train_dataloader", sampler, batch_size)

    @abc.abstractmethod
    def train_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        """Return the loss, a tuple/list whose first item is the loss, or a dict with ``"loss"``."""

    # -- optional ---------------------------------------------------------------------
    def get_val_dataloaders(self, sampler: Any, batch_size: int) -> Loaders:
        """One loader, a dict ``{name: loader}``, or None for no validation (default: the data module's)."""
        return None if self.datamodule is None else data_module_loader(self.datamodule, "val_dataloader", sampler, batch_size)

    def get_test_dataloaders(self, sampler: Any, batch_size: int) -> Loaders:
        """Like :meth:`get_val_dataloaders`, for :meth:`Trainer.test`."""
        return None if self.datamodule is None else data_module_loader(self.datamodule, "test_dataloader", sampler, batch_size)

    def val_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        """Return the loss (per sample or per batch) first, then any per-sample outputs; or return
        None and only ``self.log(...)`` (Lightning's usual validation step): no ``val_loss`` then,
        what is logged is what is recorded."""
        raise NotImplementedError(f"{type(self).__name__} returns validation loaders but does not implement val_step")

    def test_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        """Defaults to :meth:`val_step`."""
        return self.val_step(global_step, batch, device)

    def get_predict_dataloader(self, sampler: Any, batch_size: int) -> Optional[DataLoader]:
        """The loader :meth:`Trainer.predict` runs, built with ``sampler(dataset)`` (dataset order, not
        padded: every sample is predicted once across ranks). None (the default, or the data module's): no prediction."""
        return None if self.datamodule is None else data_module_loader(self.datamodule, "predict_dataloader", sampler, batch_size)

    def predict_step(self, global_step: int, batch: Any, device: torch.device) -> Any:
        """What :meth:`Trainer.predict` keeps for one batch: a tensor (first dimension: the
        batch's samples), a tuple or a dict of them. Defaults to ``self(batch)`` (the module's
        ``forward``); override it when a batch holds more than the input, e.g. ``(x, y)``."""
        if type(self).forward is torch.nn.Module.forward:
            raise NotImplementedError(
                f"{type(self).__name__} defines neither predict_step nor forward; implement "
                "predict_step(self, global_step, batch, device) to return the predictions for a batch"
            )
        return self(batch)

    def setup(self) -> None:
        """Build what depends on the rank, once, on every rank (Lightning's ``setup``).

        Called by ``Trainer(...)`` after the process group is joined, so ``self.global_rank``
        and ``self.world_size`` are known, and before any loader, optimizer or wrapper is
        built (layers created here are trained, moved to the device and sharded like the
        rest). E.g. an environment seeded by rank:
        ``self.env = make_env(seed=1000 + self.global_rank)``.
        """

    def configure_model(self) -> None:
        """Build layers here instead of in ``__init__`` (Lightning's hook): called once, before the
        strategy wraps the module; under ``fsdp`` and ``model-parallel`` inside
        ``torch.device("meta")``, so each rank allocates only its shard, initialized from the
        run's seed (``init_weights()``, else each layer's ``reset_parameters()``). See
        ``docs/distributed.md``."""

    def sharding_units(self) -> Optional[List[torch.nn.Module]]:
        """The submodules that are sharded (``fsdp``) and compiled (``compile=True``) as one unit each.

        None (the default): every block of every ``nn.ModuleList`` and ``nn.ModuleDict`` in
        the module (a transformer's layers). Return a list of submodules to choose others; what no unit
        holds belongs to the root unit. See ``docs/distributed.md``.
        """
        return None

    def tensor_parallel_plan(self) -> Optional[Dict[str, Any]]:
        """How the ``model-parallel`` backends split this module's layers over the ``tp`` ranks:
        submodule names relative to the module (wildcards as ``parallelize_module`` takes them)
        to a ``ParallelStyle``, e.g. ``{"layers.*.mlp.up": ColwiseParallel(), "layers.*.mlp.down":
        RowwiseParallel()}``. None (the default): no plan; define this or :meth:`parallelize` to
        train on a model-parallel backend. See ``docs/model-parallel.md``.
        """
        return None

    def pipeline_stages(self, num_stages: int) -> Optional[List[List[str]]]:
        """Under ``pipeline_parallel_size > 1``: each stage's top-level names (children, and blocks as
        ``"layers.3"``), e.g. ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``. None (the
        default): the first ``nn.ModuleDict``/``nn.ModuleList`` of blocks split evenly, what comes before it on
        the first stage, what comes after on the last. A pipeline also needs ``pipeline_inputs(batch) ->
        (inputs tuple of the first stage, target)`` and ``pipeline_loss(outputs, target) -> loss`` (no
        defaults), and a ``forward`` that runs the parts a stage holds (a removed child is None)."""
        return None

    def parallelize(self, tp_mesh: Any) -> None:
        """Split the module over ``tp_mesh`` (the ``tp`` axis), for full control; the default
        applies :meth:`tensor_parallel_plan` with ``parallelize_module``. Called once by the
        ``model-parallel`` backends, before activation checkpointing, compile and FSDP2."""
        from torch.distributed.tensor.parallel import parallelize_module

        plan = self.tensor_parallel_plan()
        if plan is None:
            raise ValueError(f"{type(self).__name__} defines neither tensor_parallel_plan() nor parallelize(tp_mesh)")
        parallelize_module(self, tp_mesh, plan)

    setattr(parallelize, DEFAULT_PARALLELIZE_MARK, True)  # the strategy applies the plan itself

    def get_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the module: by default its ``state_dict``, and its
        :attr:`hparams` under ``"hyper_parameters"`` where :meth:`save_hyperparameters` saved any."""
        state: Dict[str, Any] = {"model": self.state_dict()}
        if self.datamodule is not None and self.datamodule.state_dict():
            state["datamodule"] = self.datamodule.state_dict()
        if self.hparams:
            state[HYPER_PARAMETERS_KEY] = dict(self.hparams)
        return state

    def update_state(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`get_state` returned. Saved hyper-parameters are a record: a module
        that saved its own keeps them (a fine-tune from another run's weights records its own
        settings); one that saved none takes the checkpoint's as :attr:`hparams`."""
        self.load_state_dict(state["model"])
        if self.datamodule is not None and isinstance(state.get("datamodule"), dict):
            self.datamodule.load_state_dict(state["datamodule"])
        if isinstance(state.get(HYPER_PARAMETERS_KEY), dict) and not self.hparams:
            self.__dict__["_hparams"] = AttributeDict(state[HYPER_PARAMETERS_KEY])

    # -- hyper-parameters (Lightning's names) ------------------------------------------
    def save_hyperparameters(self, *names: Any, ignore: Union[str, Sequence[str]] = ()) -> None:
        """Keep the calling ``__init__``'s arguments (or only ``names``, or one dict) as
        :attr:`hparams`; the trainer writes them to ``config.yaml`` (section
        ``hyper_parameters``) and every checkpoint keeps them (restored with the weights into a module
        that saved none of its own: see :meth:`update_state`).

        Values must be plain: None, bool, int, float, str, and lists and string-keyed dicts of
        them. Read from ``__init__``, other values (a tensor, a module) are skipped with a warning
        naming them (``ignore=[...]`` skips them quietly); named or given in a dict, they are refused.

        Raises:
            TypeError: a named or given value is not plain (the message names it).
            ValueError: a name that is not an argument of ``__init__``.

        Example:
            >>> class Net(ModuleInterface):
            ...     def __init__(self, hidden: int = 32, lr: float = 0.1):
            ...         super().__init__()
            ...         self.save_hyperparameters()
            ...     get_optimizers_schedulers = get_train_dataloader = train_step = None
            >>> Net(hidden=64).hparams
            {'hidden': 64, 'lr': 0.1}
        """
        frame = inspect.currentframe()
        try:
            values, _ = hyperparameters.capture(self, names, ignore, None if frame is None else frame.f_back)
        finally:
            del frame
        self.__dict__["_hparams"] = AttributeDict(values)

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyper-parameters, read as attributes (``self.hparams.lr``); empty until saved."""
        return self.__dict__.setdefault("_hparams", AttributeDict())

    # -- where the module runs ---------------------------------------------------------
    _trainer: Optional["TrainerView"] = None  # set by attach()
    _metric_logger: Optional["MetricCollector"] = None  # where self.log records; None: nowhere

    def attach(self, trainer: "TrainerView", metric_logger: Optional["MetricCollector"]) -> None:
        """Called by ``Trainer(...)``: the trainer this module runs in, and where ``self.log`` records."""
        self._trainer = trainer
        self._metric_logger = metric_logger
        if self.hparams:  # into the config.yaml the trainer writes when training starts
            hyperparameters.add_to_config(trainer.args, self.hparams)

    @property
    def trainer(self) -> "TrainerView":
        """The trainer running this module (an error outside one)."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; build Trainer(module=...) first")
        return trainer

    @property
    def global_rank(self) -> int:
        """This process's rank (0 outside distributed training)."""
        trainer = self._trainer
        return trainer.backend.rank if trainer is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes training together (1 outside distributed training)."""
        trainer = self._trainer
        return trainer.backend.world_size if trainer is not None else 1

    @property
    def current_epoch(self) -> int:
        """The epoch being trained, counting from 0."""
        return self.trainer.epochs_finished

    # -- manual optimization -------------------------------------------------------------
    def optimizers(self) -> Any:
        """The optimizers (one alone, several as a list) whose ``step`` goes through the backend."""
        return one_or_list(self._manual_optimization("optimizers").optimizers)

    def lr_schedulers(self) -> Any:
        """The schedulers (one alone, several as a list, None without); step them yourself."""
        return one_or_list(self._manual_optimization("lr_schedulers").schedulers)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)`` through the backend: fp16 loss scaling, DDP and
        FSDP gradient sync. ``args``/``kwargs`` are ``Tensor.backward``'s (``retain_graph=True``).

        May be called several times per ``train_step`` (one per optimizer, or per chunk).
        """
        self._manual_optimization("manual_backward").backward(loss, *args, **kwargs)

    def clip_gradients(
        self, optimizer: Any, max_norm: Optional[float] = None, max_value: Optional[float] = None
    ) -> Optional[torch.Tensor]:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under fp16).

        Returns the total norm before clipping when ``max_norm`` is given.
        """
        return self._manual_optimization("clip_gradients").clip_gradients(optimizer, max_norm, max_value)

    def _manual_optimization(self, method: str) -> ManualOptimization:
        manual = None if self._trainer is None else self._trainer.manual_optimization
        if manual is None:
            raise RuntimeError(
                f"self.{method}() is for manual optimization: set automatic_optimization = False on "
                f"{type(self).__name__} and call it from train_step while a Trainer trains it"
            )
        return manual

    def log(
        self,
        name: str,
        value: Union[torch.Tensor, float, Any],
        on_step: bool = False,
        on_epoch: bool = True,
        reduce: str = "mean",
        batch_size: Optional[int] = None,
        prog_bar: bool = False,
        sync_dist: bool = True,
        logger: bool = True,
    ) -> None:
        """Record a metric from inside a step; it stays on the device until it is written.

        ``on_step`` values are written at the next ``log_every_n_steps`` point; ``on_epoch``
        values are reduced (``mean``, ``sum``, ``max`` or ``min``) over the epoch and over
        ranks when the train or evaluation epoch ends. A ``mean`` is weighted by
        ``batch_size`` (default: the first dimension of the step's batch's first tensor, as
        Lightning infers it; 1 outside a step), so the epoch value is the mean over samples on
        any world size. Outside a trainer this does nothing.

        ``value`` may be a torchmetrics ``Metric`` (as in Lightning): update it in the step
        yourself (``self.acc.update(preds, y)`` or ``self.acc(preds, y)``) and log the object;
        at the epoch's end the trainer calls its ``compute()`` (torchmetrics syncs it over
        ranks) and then ``reset()``. ``prog_bar=True`` shows the value on the progress bar.
        ``sync_dist`` is accepted for Lightning code and changes nothing: values are always
        reduced over ranks, at log points and epoch ends only, so it costs no extra sync.
        ``logger=False`` (Lightning's name) keeps the value out of the loggers (``metrics.csv``,
        TensorBoard, ...): it still reaches ``trainer.history``, callbacks and the progress bar.

        Example:
            self.log("val_acc", self.val_acc, prog_bar=True)   # self.val_acc: torchmetrics Accuracy
        """
        if prog_bar:
            self.__dict__.setdefault("_prog_bar_names", set()).add(name)
        if not logger:
            self.__dict__.setdefault("_logger_off_names", set()).update((name, name + "_epoch"))
        metric_logger = self._metric_logger
        if metric_logger is not None:
            metric_logger.log(name, value, on_step=on_step, on_epoch=on_epoch, reduce=reduce, batch_size=batch_size)

    def logger_off_names(self) -> Set[str]:
        """The series logged with ``logger=False`` so far (kept out of the loggers)."""
        return self.__dict__.get("_logger_off_names", set())

    def progress_bar_names(self) -> Set[str]:
        """The names logged with ``prog_bar=True`` so far (what the progress bar shows)."""
        return set(self.__dict__.get("_prog_bar_names", ()))


class StepRunner(torch.nn.Module):
    """Routes ``forward(stage, ...)`` to the module's step method.

    Strategies wrap this object (DDP included), so every training step goes through a
    wrapper's ``forward`` and its gradient hooks fire; the user's own ``forward`` stays free.
    """

    _target: ModuleInterface
    _STEP_METHODS: ClassVar[Dict[Stage, str]] = {
        Stage.TRAIN: "train_step",
        Stage.VAL: "val_step",
        Stage.TEST: "test_step",
        Stage.PREDICT: "predict_step",
    }

    def __init__(self, module: ModuleInterface) -> None:
        super().__init__()
        self.module = module  # registered, so wrappers (DDP) see its parameters
        self.__dict__["_target"] = module  # plain attribute: no nn.Module lookup per step

    def forward(self, stage: Stage, global_step: int, batch: Any, device: torch.device, *extra: Any) -> Any:
        collector = self._target._metric_logger
        if collector is None:
            return getattr(self._target, self._STEP_METHODS[stage])(global_step, batch, device, *extra)
        collector.batch = batch  # self.log weights a mean by this batch's size
        try:
            return getattr(self._target, self._STEP_METHODS[stage])(global_step, batch, device, *extra)
        finally:
            collector.batch = None


def as_loader_dict(loaders: Loaders, method: str) -> Dict[str, DataLoader]:
    """``None`` -> ``{}``, one loader -> ``{"val": loader}``-style dict, a dict unchanged."""
    if loaders is None:
        return {}
    if isinstance(loaders, dict):
        return dict(loaders)
    if isinstance(loaders, (list, tuple)):
        raise TypeError(f"{method} must return a DataLoader, a dict of DataLoaders or None; got {type(loaders).__name__}")
    return {"": loaders}
