"""Which weights ``validate``/``test``/``predict`` use: the current ones, or a checkpoint's, the
same file on every rank (rank zero picks it and broadcasts where it is)."""

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from backends import TrainerBackend
from framework.callbacks.base import Callback, callback_states, saved_states
from framework.checkpoint.abstract import AbstractCheckpointer
from framework.checkpoint.weights import load_checkpoint_into, resolve_checkpoint

logger = logging.getLogger("framework")

CheckpointChoice = Optional[str]
"""``None`` (the current weights), ``"last"``, ``"best"``, or a checkpoint file or directory."""


def check_checkpoint_choice(checkpoint: Any, method: str) -> None:
    """Refuse anything but None, ``"last"``, ``"best"`` or a non-empty path.

    Example:
        >>> check_checkpoint_choice(3, "validate")
        Traceback (most recent call last):
        ...
        TypeError: validate(checkpoint=3): allowed: None (the current weights), 'last', 'best', or a checkpoint file or ...
    """
    if checkpoint is None or (isinstance(checkpoint, str) and checkpoint):
        return
    raise TypeError(
        f"{method}(checkpoint={checkpoint!r}): allowed: None (the current weights), 'last', 'best', "
        "or a checkpoint file or directory (a path or fsspec URL)"
    )


def on_main_then_everywhere(backend: Any, compute: Callable[[], Any], what: str) -> Any:
    """``compute()`` on rank zero, its result on every rank; a failure there is raised on every
    rank (see ``Strategy.run_on_rank_zero``)."""
    return backend.run_on_rank_zero(compute, f"failed to {what}")


def best_checkpoint_url(checkpointer: AbstractCheckpointer, backend: TrainerBackend) -> Optional[str]:
    """Rank zero's ``checkpointer.best_checkpoint()`` on every rank (rank zero scores the
    checkpoints it keeps). Collective under DDP: call it on every rank."""
    return on_main_then_everywhere(backend, checkpointer.best_checkpoint, "find the best checkpoint")


def load_evaluation_weights(
    module: torch.nn.Module,
    checkpointer: AbstractCheckpointer,
    backend: TrainerBackend,
    checkpoint: CheckpointChoice,
    method: str,
    weights_known: bool,
    callbacks: Sequence[Callback] = (),
) -> Optional[str]:
    """Load the weights ``checkpoint`` names into ``module`` on every rank; return the file's URL
    (None: the current weights are kept). Each of ``callbacks`` (set up) gets its state saved
    in that checkpoint through ``load_evaluation_state`` (a weight average: the one of that
    step, so the checkpoint is evaluated as training evaluated it).

    - ``None``: nothing is loaded. When the weights are not known (``weights_known``: the
      trainer has trained, resumed or loaded a checkpoint) and the checkpointer would resume
      from a checkpoint, rank zero warns that the untrained weights are evaluated and how to
      evaluate the checkpoint instead.
    - ``"last"``: the newest readable checkpoint in ``save_dir`` (else in what the run resumes
      from: ``load_filename`` / ``load_dir``).
    - ``"best"``: the best checkpoint by ``checkpointer_args.metric`` / ``mode``: among this
      run's scored ones, else from the run history saved in ``save_dir``.
    - a path or URL: that checkpoint file (or model export), or the newest in that directory.

    Rank zero resolves the checkpoint and shares its URL; every rank then loads it through
    the strategy (``fsdp``: each rank its own shards of a sharded checkpoint).

    Raises:
        TypeError: ``checkpoint`` is none of the above.
        FileNotFoundError, ValueError: no such checkpoint (on every rank).
    """
    check_checkpoint_choice(checkpoint, method)
    if checkpoint is None:
        if not weights_known and backend.is_main_process:
            _warn_if_untrained(checkpointer, method)
        return None
    url = backend.run_on_rank_zero(
        lambda: _resolve_on_main(checkpointer, checkpoint),
        f"failed to load checkpoint={checkpoint!r}",
        share_as=(FileNotFoundError, ValueError),
    )
    _, trainer_state = load_checkpoint_into(  # through the strategy's CheckpointIO (fsdp: each rank its shards)
        module, url, checkpointer.weights_only, backend.strategy, {"callbacks": callback_states(callbacks)}
    )
    for callback, saved in saved_states(callbacks, trainer_state.get("callbacks", [])):
        callback.load_evaluation_state(saved)
    logger.info("%s: evaluating the weights of %s", method, url)
    return url


def _resolve_on_main(checkpointer: AbstractCheckpointer, checkpoint: str) -> str:
    """The URL of the checkpoint ``checkpoint`` names (rank zero reads candidates to find it)."""
    weights_only, save_dir = checkpointer.weights_only, checkpointer.save_dir
    if checkpoint not in ("last", "best"):
        return resolve_checkpoint(checkpoint, weights_only=weights_only)
    if save_dir is None:
        raise ValueError(
            f"checkpoint={checkpoint!r} needs a checkpointer with a save_dir ({type(checkpointer).__name__} has none); "
            "pass the checkpoint's path instead"
        )
    if checkpoint == "best":
        scored = checkpointer.best_checkpoint()
        if scored is not None:
            return resolve_checkpoint(scored, weights_only=weights_only)
        metric, mode = checkpointer.metric, checkpointer.mode
        return resolve_checkpoint(save_dir, step="best", metric=metric, mode=mode, weights_only=weights_only)
    try:
        return resolve_checkpoint(save_dir, step="last", weights_only=weights_only)
    except FileNotFoundError:
        source = checkpointer.resume_source()
        if source is None or source == save_dir:
            raise FileNotFoundError(
                f"checkpoint='last': save_dir {save_dir!r} holds no checkpoint, and there is no load_filename or "
                "load_dir to take one from; train first, or pass a checkpoint's path"
            ) from None
        return resolve_checkpoint(source, step="last", weights_only=weights_only)


def _warn_if_untrained(checkpointer: AbstractCheckpointer, method: str) -> None:
    try:
        source = checkpointer.resume_source()
    except OSError:  # listing the directory failed: say nothing rather than fail the evaluation
        return
    if source is not None:
        logger.warning(
            "%s() evaluates the current weights, which this trainer has neither trained nor loaded, while %s holds "
            "a checkpoint train() would resume from: pass checkpoint='last' (or 'best', or a path) to evaluate it",
            method,
            source,
        )
