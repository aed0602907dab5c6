"""Checks of what the user's module and callbacks hand the trainer, made once, before they can hurt.

Each check raises an error that names the method (or hook, or checkpoint file) at fault and
what is allowed. None of them runs per step: they run at setup, on the first step, or on resume.
"""

import contextlib
import inspect
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from backends import TrainerBackend
from framework.config.arguments import TrainerArguments
from framework.loop.hooks import TrainingHooks
from framework.module import ModuleInterface

logger = logging.getLogger("framework")

_OPTIMIZERS_SHAPE = "([optimizers], [schedulers]), e.g. ([optimizer], [scheduler]) or ([optimizer], [])"


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the run that resumes from it (names the file and how to proceed)."""


def check_trainer_inputs(module: Any, args: Any, trainer_backend: Any) -> None:
    """Refuse a ``Trainer`` module, arguments or backend instance of the wrong type, naming it."""
    if not isinstance(module, ModuleInterface):
        raise TypeError(f"module must be a ModuleInterface, got {type(module).__name__}")
    if not isinstance(args, TrainerArguments):
        raise TypeError(f"args must be TrainerArguments, got {type(args).__name__}")
    if trainer_backend is not None and not isinstance(trainer_backend, TrainerBackend):
        raise TypeError(f"trainer_backend must be a TrainerBackend, got {type(trainer_backend).__name__}")


def check_optimizers_schedulers(returned: Any, method: str = "get_optimizers_schedulers") -> Tuple[List[Any], List[Any]]:
    """What ``get_optimizers_schedulers`` returned, as ``(optimizers, schedulers)`` lists.

    Raises:
        TypeError: not a pair of sequences (a bare optimizer, None, one list), or an item of the
            wrong kind; names ``method`` and the allowed shape.
        ValueError: no optimizer at all.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> optimizers, schedulers = check_optimizers_schedulers(([opt], None))
        >>> len(optimizers), schedulers
        (1, [])
        >>> check_optimizers_schedulers(opt)
        Traceback (most recent call last):
        ...
        TypeError: get_optimizers_schedulers must return ([optimizers], [schedulers]), e.g. ([optimizer], [scheduler]) or ([optimizer], []); got SGD
    """  # noqa: E501 - a doctest's expected error message is one line
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2 and not _is_optimizer(returned[0])):
        got = (
            type(returned).__name__
            if not isinstance(returned, (tuple, list))
            else f"a {type(returned).__name__} of {len(returned)} items"
        )
        if isinstance(returned, (tuple, list)) and len(returned) == 2:
            got = f"({type(returned[0]).__name__}, {type(returned[1]).__name__})"
        raise TypeError(f"{method} must return {_OPTIMIZERS_SHAPE}; got {got}")
    optimizers, schedulers = returned
    if not isinstance(optimizers, (list, tuple)) or not isinstance(schedulers, (list, tuple, type(None))):
        raise TypeError(
            f"{method} must return {_OPTIMIZERS_SHAPE}; got ({type(optimizers).__name__}, {type(schedulers).__name__})"
        )
    optimizers, schedulers = list(optimizers), list(schedulers or [])
    if not optimizers:
        raise ValueError(f"{method} returned no optimizer; return {_OPTIMIZERS_SHAPE}")
    for index, optimizer in enumerate(optimizers):
        if not _is_optimizer(optimizer):
            raise TypeError(
                f"{method}: optimizer {index} is a {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                f"return {_OPTIMIZERS_SHAPE}"
            )
    for index, scheduler in enumerate(schedulers):
        if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
            raise TypeError(
                f"{method}: scheduler {index} is a {type(scheduler).__name__}, not a learning-rate scheduler "
                f"(an object with step() and state_dict()); return {_OPTIMIZERS_SHAPE}"
            )
    return optimizers, schedulers


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def check_train_dataloader(loader: Any, method: str = "get_train_dataloader") -> None:
    """Refuse a train loader that is None or cannot be iterated.

    Example:
        >>> check_train_dataloader(None)
        Traceback (most recent call last):
        ...
        TypeError: get_train_dataloader returned None; it must return a DataLoader (or any iterable of batches) built with sampler(dataset)
    """  # noqa: E501 - a doctest's expected error message is one line
    if loader is None:
        raise TypeError(
            f"{method} returned None; it must return a DataLoader (or any iterable of batches) built with sampler(dataset)"
        )
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"{method} returned a {type(loader).__name__}, which cannot be iterated; return a DataLoader")


def check_train_loader_not_empty(
    loader: Any, length: Optional[int], batch_size: int, method: str = "get_train_dataloader"
) -> None:
    """Refuse a train loader whose length is 0: the run would take no step and save an empty checkpoint.

    Args:
        loader: the loader (its ``dataset`` and ``drop_last`` go into the message when present).
        length: ``len(loader)`` (the minimum over ranks under DDP), or None for a loader without one.
        batch_size: the micro-batch per process the loader was asked for.
    """
    if length is None or length > 0:
        return
    dataset = getattr(loader, "dataset", None)
    try:
        samples = f"a dataset of {len(dataset)} samples" if dataset is not None else "its dataset"
    except TypeError:
        samples = "its dataset"
    hint = " with drop_last=True" if getattr(loader, "drop_last", False) else ""
    raise ValueError(
        f"{method} returned a loader with 0 batches (len(loader) == 0) from {samples}{hint}, with batch size "
        f"{batch_size} per process: training would take no step. Give it more data, a smaller train_batch_size, "
        f"or drop_last=False"
    )


def check_loss_requires_grad(loss: Any, module: Any, method: str = "train_step") -> None:
    """On the first training step: the loss must carry a graph back to the parameters.

    Does nothing under manual optimization (``module.automatic_optimization = False``), where
    the user calls backward themselves and may return a detached loss for logging.

    Raises:
        ValueError: names ``method`` and the usual causes.
    """
    if getattr(module, "automatic_optimization", True) is False:
        return
    if isinstance(loss, torch.Tensor) and not loss.requires_grad:
        raise ValueError(
            f"{method} returned a loss that does not require grad (requires_grad=False, grad_fn=None), so backward "
            f"cannot reach the parameters: was it computed under torch.no_grad(), with .detach() or .item(), or "
            f"from parameters with requires_grad=False?"
        )


def report_no_loaders(method: str) -> None:
    """Log that ``method`` (``get_test_dataloaders``, ``get_val_dataloaders``) returned no loader."""
    logger.warning(
        "%s returned no loader (None or an empty dict): nothing to evaluate; implement %s to return a DataLoader", method, method
    )


# -- hooks -------------------------------------------------------------------------------------
def hook_names() -> List[str]:
    """The hooks of :class:`~framework.loop.hooks.TrainingHooks`, in definition order."""
    return [name for name in vars(TrainingHooks) if name.startswith("on_") and callable(getattr(TrainingHooks, name))]


def check_hook_signatures(*targets: Any) -> None:
    """Refuse overridden hooks that cannot be called the way the trainer calls them.

    The trainer passes the hook's fixed arguments by position (``global_step``, then e.g.
    ``epoch``), step outputs as further positional arguments where the hook has ``*outputs``,
    and ``key=`` by keyword for evaluation-epoch hooks. Naming the outputs
    (``def on_end_val_epoch(self, global_step, losses, correct, key)``) is fine.

    Raises:
        TypeError: names the object, the hook, its signature and the expected one.

    Example:
        >>> class Late(TrainingHooks):
        ...     def on_begin_train_epoch(self, epoch):
        ...         pass
        >>> check_hook_signatures(Late())
        Traceback (most recent call last):
        ...
        TypeError: Late.on_begin_train_epoch(epoch) does not fit the hook: it is called as on_begin_train_epoch(global_step, epoch) (it takes 1 positional argument(s), the trainer passes 2)
    """  # noqa: E501 - a doctest's expected error message is one line
    for target in targets:
        for name in hook_names():
            implementation = getattr(target, name, None)
            if implementation is None or getattr(implementation, "__func__", None) is getattr(TrainingHooks, name):
                continue
            reference = inspect.signature(getattr(TrainingHooks, name))
            problem = _signature_problem(implementation, reference, _ALWAYS_OUTPUTS.get(name, 0))
            if problem:
                expected = _format_expected(name)
                raise TypeError(
                    f"{type(target).__name__}.{name}{_format_signature(implementation)} does not fit the hook: "
                    f"it is called as {name}{expected} ({problem})"
                )


_ALWAYS_OUTPUTS = {
    "on_end_train_step": 1,  # the loss at least
    "on_end_val_step": 1,
    "on_end_test_step": 1,
    "on_end_val_epoch": 1,
    "on_end_test_epoch": 1,
}
"""Hooks with ``*outputs`` that always receive at least this many outputs (``on_end_train_epoch``
receives them only with ``collect_train_outputs``)."""


def check_module_setup(module: Any) -> None:
    """Refuse a module ``setup`` that cannot be called as ``setup()`` (e.g. Lightning's ``setup(self, stage)``).

    Raises:
        TypeError: names the module, its signature and the expected one.

    Example:
        >>> class Ported(torch.nn.Module):
        ...     def setup(self, stage):
        ...         pass
        >>> check_module_setup(Ported())
        Traceback (most recent call last):
        ...
        TypeError: Ported.setup(stage) does not fit the hook: it is called as setup(), once, on every rank, by Trainer(...) (give stage a default or remove it)
    """  # noqa: E501 - a doctest's expected error message is one line
    setup = getattr(module, "setup", None)
    if setup is None:
        return
    try:
        inspect.signature(setup).bind()
    except TypeError:
        required = [
            p.name
            for p in inspect.signature(setup).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        raise TypeError(
            f"{type(module).__name__}.setup{_format_signature(setup)} does not fit the hook: it is called as setup(), "
            f"once, on every rank, by Trainer(...) (give {', '.join(required)} a default or remove it)"
        ) from None
    except ValueError:
        return  # a C callable: cannot tell


def _signature_problem(implementation: Any, reference: inspect.Signature, always_outputs: int = 0) -> Optional[str]:
    if not callable(implementation):
        return f"it is a {type(implementation).__name__}, not a method"
    try:
        signature = inspect.signature(implementation)
    except (TypeError, ValueError):
        return None  # builtins and C callables: cannot tell
    parameters = list(signature.parameters.values())
    reference_parameters = [p for p in reference.parameters.values() if p.name != "self"]
    fixed = [p for p in reference_parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    takes_outputs = any(p.kind is p.VAR_POSITIONAL for p in reference_parameters)
    keywords = [p.name for p in reference_parameters if p.kind is p.KEYWORD_ONLY]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in keywords]
    has_var_positional = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    has_var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    if len(positional) < len(fixed) and not has_var_positional:
        return f"it takes {len(positional)} positional argument(s), the trainer passes {len(fixed)}"
    if takes_outputs and len(positional) < len(fixed) + always_outputs and not has_var_positional:
        return (
            f"it takes {len(positional)} positional argument(s), the trainer passes {len(fixed)} and then the step's "
            "outputs (at least the loss): add *outputs"
        )
    required = [p for p in positional if p.default is p.empty]
    if not takes_outputs and len(required) > len(fixed):
        return f"it requires {len(required)} positional arguments, the trainer passes {len(fixed)}"
    for keyword in keywords:
        accepted = signature.parameters.get(keyword)
        if (accepted is None or accepted.kind is accepted.POSITIONAL_ONLY) and not has_var_keyword:
            return f"it has no {keyword!r} parameter, which the trainer passes by keyword"
    for parameter in parameters:
        if parameter.kind is parameter.KEYWORD_ONLY and parameter.default is parameter.empty and parameter.name not in keywords:
            return f"its keyword-only parameter {parameter.name!r} has no default and the trainer never passes it"
    return None


def _format_signature(implementation: Any) -> str:
    try:
        return str(inspect.signature(implementation))
    except (TypeError, ValueError):
        return "(...)"


def _format_expected(name: str) -> str:
    parameters = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in inspect.signature(getattr(TrainingHooks, name)).parameters.values()
        if p.name != "self"
    ]
    return str(inspect.Signature(parameters))


# -- resuming ----------------------------------------------------------------------------------
def check_optimizer_state_compatible(
    saved_trainer_state: Dict[str, Any],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    checkpoint_path: Optional[str],
    one_stage: bool = False,
) -> None:
    """Refuse to resume when the checkpoint's optimizers or schedulers do not match this run's.

    ``one_stage``: this rank holds one pipeline stage, whose groups hold part of each saved group's
    parameters (which ones, by name, is checked when the state loads).

    Compares the number of optimizers, each optimizer's parameter groups (and parameters per
    group), and the number of schedulers. Without this check, extra ones are silently left
    fresh and mismatched groups fail deep inside ``load_state_dict``.

    Raises:
        CheckpointMismatch: names the checkpoint file, what differs, and suggests
            ``reset_optimizers_schedulers``.
    """
    where = checkpoint_path or "the checkpoint"
    saved_optimizers = _saved(saved_trainer_state, "optimizers", where)
    saved_schedulers = _saved(saved_trainer_state, "schedulers", where)
    problem = None
    if len(saved_optimizers) != len(optimizers):
        problem = f"it holds {len(saved_optimizers)} optimizer(s), get_optimizers_schedulers returned {len(optimizers)}"
    else:
        for index, (saved, optimizer) in enumerate(zip(saved_optimizers, optimizers)):
            saved_groups = [len(group.get("params", ())) for group in saved.get("param_groups", [])]
            groups = [len(group["params"]) for group in optimizer.param_groups]
            if len(saved_groups) != len(groups):
                problem = f"optimizer {index} has {len(saved_groups)} parameter group(s) in it, {len(groups)} in this run"
                break
            if saved_groups != groups and not (one_stage and all(mine <= it for mine, it in zip(groups, saved_groups))):
                problem = f"optimizer {index}'s parameter groups hold {saved_groups} parameters in it, {groups} in this run"
                break
    if problem is None and len(saved_schedulers) != len(schedulers):
        problem = f"it holds {len(saved_schedulers)} scheduler(s), get_optimizers_schedulers returned {len(schedulers)}"
    if problem is not None:
        raise CheckpointMismatch(
            f"checkpoint {where} does not match this run's optimizers and schedulers: {problem}. To keep its model "
            f"weights and start the optimizers, schedulers and counters afresh, set "
            f"checkpointer_args.reset_optimizers_schedulers=True (--checkpointer.reset_optimizers_schedulers true) "
            f"and load it with load_filename/load_dir"
        )


def _saved(state: Dict[str, Any], key: str, where: str) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise CheckpointMismatch(
            f"checkpoint {where}: its trainer state has no {key!r} entry; "
            "it was not written by this trainer (or by an incompatible version)"
        )
    return state[key]


@contextlib.contextmanager
def naming_missing_keys(checkpoint_path: Optional[str], part: str = "trainer state") -> Iterator[None]:
    """Turn a ``KeyError`` raised while restoring a checkpoint into an error naming the key and file.

    Example:
        >>> with naming_missing_keys("ckpt.pt"):
        ...     {}["ranks"]
        Traceback (most recent call last):
        ...
        framework.loop.module_checks.CheckpointMismatch: checkpoint ckpt.pt: its trainer state has no 'ranks' entry; it was not written by this trainer (or by an incompatible version)
    """  # noqa: E501 - a doctest's expected error message is one line
    try:
        yield
    except KeyError as error:
        key = error.args[0] if error.args else "?"
        raise CheckpointMismatch(
            f"checkpoint {checkpoint_path or '(unnamed)'}: its {part} has no {key!r} entry; it was not written by this "
            f"trainer (or by an incompatible version)"
        ) from error


def check_optimization_mode(module: "ModuleInterface", args: TrainerArguments, accumulation: int) -> bool:
    """The module's ``automatic_optimization``, after refusing settings manual mode cannot apply."""
    automatic = module.automatic_optimization
    if not isinstance(automatic, bool):
        raise TypeError(f"{type(module).__name__}.automatic_optimization={automatic!r}; allowed: True or False")
    if automatic:
        return True
    refused = {
        "gradient accumulation (train_batch_size / world size > gpu_batch_size_limit)": accumulation > 1,
        "gpu_batch_size_limit='auto' (it may accumulate micro-batches)": args.gpu_batch_size_limit == "auto",
        "tbptt_steps (split the batch in train_step instead)": args.tbptt_steps is not None,
        "clip_grads / clip_grad_value (call self.clip_gradients in train_step)": args.clip_grads
        or args.clip_grad_value is not None,
        "track_grad_norm (clip_gradients returns the norm: self.log it)": args.track_grad_norm,
    }
    for setting, applies in refused.items():
        if applies:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization = False), where the "
                f"trainer runs no backward and no optimizer step itself, so {setting} cannot apply; remove it"
            )
    return False
