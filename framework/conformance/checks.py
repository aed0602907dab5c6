"""Running one cell of the matrix on one rank: the context, the helpers every feature uses,
and :func:`run_cells`.

A feature (``framework/conformance/features_*.py``) runs on every rank of one process group (or
in one process) and returns plain data (lists, numbers, strings).
:mod:`framework.conformance.compare` turns a backend's observations and the reference's into
a row of the table.
"""

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, ContextManager, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from backends import build_backend
from framework.callbacks import Callback
from framework.checkpoint import AbstractCheckpointer, DefaultCheckpointer, DefaultCheckpointerArguments
from framework.config.arguments import TrainerArguments
from framework.conformance.layouts import layout_options
from framework.conformance.matrix import Cell
from framework.conformance.registry import FEATURES, build_model
from framework.data.rng import seed_everything
from framework.loop.trainer import Trainer

RANK_SEED_STRIDE = 1000
"""Each rank seeds its generators with ``seed + RANK_SEED_STRIDE * rank`` before it builds its
module, as ranks of a real program differ: a backend must start every rank from rank zero's
weights (the ``sp`` reference is built as rank zero builds it)."""


KIT_SEED = 7
"""The run seed of every cell (not 0: a sampler that ignores the seed must not pass as one that takes it)."""


@dataclass
class Context:
    """Where a cell runs: the backend's name, a directory shared by the ranks, the rank.

    ``shared`` is the kit's top directory (the 1-rank run leaves checkpoints there that the
    multi-rank run resumes: the world-size change); ``declared`` the features the backend
    declares unsupported (the cell then expects a refusal before step 1).
    """

    backend: str
    workdir: str
    rank: int = 0
    world_size: int = 1
    use_gpu: bool = False
    shared: str = ""
    declared: Dict[str, str] = field(default_factory=dict)


class AbruptStop(BaseException):
    """Raised from a hook to end a run at once: no final checkpoint, as after ``kill -9``."""


class StopAt(Callback):
    """At optimizer step ``step`` (``step + skew * rank`` on rank ``rank``: signals arriving a step
    apart, as a launcher's reach each rank): send ``how`` (a signal name) to this process, end the
    run abruptly (``how="abrupt"``), or ask the trainer to stop (``how="request"``:
    ``trainer.should_stop``, as ``EarlyStopping`` does). ``others``: what ranks other than zero do
    instead (different stop reasons per rank)."""

    def __init__(self, step: int, how: str, skew: int = 0, others: Optional[str] = None) -> None:
        self.step, self.how, self.skew, self.others = step, how, skew, others

    def on_end_optimizer_step(self, global_step: int) -> None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if global_step == self.step + self.skew * rank:
            how = self.others if rank and self.others else self.how
            if how == "abrupt":
                raise AbruptStop(f"stopped abruptly at step {global_step}")
            if how == "request":
                self.trainer.should_stop = True
                return
            os.kill(os.getpid(), getattr(signal, how))


SLOW_WRITE = 0.5
"""Seconds rank zero's checkpoint writes are delayed by :class:`SlowRankZeroWrites`."""


class SlowRankZeroWrites(DefaultCheckpointer):
    """A checkpointer whose rank zero writes each checkpoint file :data:`SLOW_WRITE` seconds late (a
    slow filesystem: its ``serialize``, the documented override point, sleeps first): a rank that
    leaves a save before rank zero's file is in place reads the checkpoint directory too early.

    Example:
        >>> SlowRankZeroWrites(DefaultCheckpointerArguments(save_dir="memory://slow-writes")).save_dir
        'memory://slow-writes'
    """

    def serialize(self, obj: Any, handle: IO[bytes]) -> None:
        if self.strategy.is_main_process and self.strategy.world_size > 1:
            time.sleep(SLOW_WRITE)
        super().serialize(obj, handle)


class _CountSteps(Callback):
    """Counts optimizer steps of every trainer the kit builds (a refusal must come before step 1)."""

    steps = 0

    def on_end_optimizer_step(self, global_step: int) -> None:
        _CountSteps.steps += 1


def run_dir(context: Context, name: str) -> str:
    """This backend's directory for the run ``name`` (shared by its ranks)."""
    return os.path.join(context.workdir, context.backend, name)


def make_args(context: Context, name: str, **overrides: Any) -> TrainerArguments:
    """The kit's run arguments (seed :data:`KIT_SEED`): 2 epochs of global batch 16 over 64 samples, quiet, no
    checkpoints; the mesh the backend runs in at this world size (see :mod:`framework.conformance.layouts`)."""
    values: Dict[str, Any] = dict(
        backend=context.backend,
        epochs=2,
        train_batch_size=16,
        seed=KIT_SEED,
        disable_tqdm=True,
        model_summary=False,
        log_level="ERROR",
        use_gpu=context.use_gpu,
        ddp_timeout=120.0,
        output_dir=run_dir(context, name),
        checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
        log_every_n_steps=1,  # every step's values are recorded: cells compare the trajectory, not only its end
        plot_metrics=False,  # the kit's trainers start no drawing process
        # No sanity validation: its evaluation runs on rank zero's buffers, which would hide a
        # strategy that never synchronises the per-rank buffers the kit starts from.
        sanity_val_steps=0,
    )
    values.update(layout_options(context.backend, context.world_size))  # at 4 ranks: HSDP 2x2, dp 2 x tp 2
    values.update(overrides)
    return TrainerArguments(**values)


def make_trainer(
    context: Context,
    model: str,
    args: TrainerArguments,
    callbacks: Sequence[Any] = (),
    checkpointer: Optional[AbstractCheckpointer] = None,
    **options: Any,
) -> Trainer:
    """The zoo model ``model`` built after seeding by rank (ranks start from different weights
    and generators, as a real program's do), then its trainer (``checkpointer``: None, the default one)."""
    seed_everything(args.seed + RANK_SEED_STRIDE * context.rank)
    return Trainer(build_model(model, **options), args, callbacks=[*callbacks, _CountSteps()], checkpointer=checkpointer)


def saving(context: Context, name: str, **overrides: Any) -> DefaultCheckpointerArguments:
    """Checkpoints every 2 steps into the run's directory, resumed automatically."""
    values: Dict[str, Any] = dict(
        save_dir=os.path.join(run_dir(context, name), "checkpoints"),
        period=0,
        save_every_n_steps=2,
        save_at_end=False,
        resume="auto",
    )
    values.update(overrides)
    return DefaultCheckpointerArguments(**values)


def barrier() -> None:
    """Wait for every rank (nothing on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def described(error: BaseException, length: int = 300) -> str:
    """``"Type: first line"`` of an error."""
    first = (str(error).strip().splitlines() or [""])[0][:length]
    return f"{type(error).__name__}: {first}"


def _refused(context: Context, feature: str, run: Callable[[], Any]) -> Dict[str, Any]:
    """A declared-unsupported cell: the backend must refuse it before step 1."""
    _CountSteps.steps = 0
    try:
        run()
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        if _CountSteps.steps:
            return {"error": f"declared unsupported, failed after {_CountSteps.steps} step(s): {described(error)}"}
        return {"refused": described(error, 400)}
    return {"error": f"declared unsupported ({context.declared[feature]}) but ran {_CountSteps.steps} step(s) without refusing"}


def cell_key(feature: str, model: str) -> str:
    """The key of a cell's observations."""
    return f"{feature}/{model}"


def run_cells(
    context: Context, cells: Sequence[Cell], around: Optional[Callable[[], ContextManager[None]]] = None
) -> Dict[str, Any]:
    """Run each (feature, model) in order; a cell that raises is recorded as ``{"error": ...}``.

    ``around()`` (the kit's ranks: a process group of the cell's own) is entered for each cell;
    an error in entering or leaving it is the cell's error too."""
    torch.set_num_threads(1)
    observed: Dict[str, Any] = {}
    unbuildable = harness_error(context.backend)
    if unbuildable is not None:
        return {cell_key(*cell): {"harness": unbuildable} for cell in cells}
    for feature, model in cells:
        key = cell_key(feature, model)
        try:
            with around() if around is not None else contextlib.nullcontext():
                observed[key] = _run_cell(context, feature, model)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            observed[key] = {"error": described(error)}
    return observed


def harness_error(backend: str) -> Optional[str]:
    """Why ``backend`` cannot be built in this process (an unknown name: a plugin not imported
    here), or None: a cell that cannot start is the harness's error, not the backend's verdict."""
    try:
        build_backend(backend)
    except Exception as error:  # any failure to build is reported, with its type
        return f"backend {backend!r} cannot be built on this rank: {described(error)}"
    return None


def _run_cell(context: Context, feature: str, model: str) -> Dict[str, Any]:
    local = Context(**{**context.__dict__, "workdir": os.path.join(context.workdir, feature, model)})
    run = FEATURES[feature].run
    if feature in context.declared:
        return _refused(context, feature, functools.partial(run, local, model))
    return run(local, model)


def find_unused(context: Context) -> Dict[str, Any]:
    """``find_unused_parameters=True`` where the backend takes the option (a manual step's second
    backward leaves the body unused; sp and fsdp do not take it)."""
    return {"find_unused_parameters": True} if "find_unused_parameters" in build_backend(context.backend).options else {}
