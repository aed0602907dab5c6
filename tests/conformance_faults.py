"""Backends with one fault each, small subclasses of the built-in ones: the conformance matrix
must fail each of them, naming the cell (``tests/test_conformance.py``). Importing this module
registers them (the kit's ranks import it by name: ``--import conformance_faults``)."""

import contextlib
from typing import Any, ContextManager, Iterator, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from backends import DDP, FullPrecision, MixedPrecision, SingleProcess, TrainerBackend, register_backend


class NoAllReduce(DDP):
    """Joins the process group but never wraps the module: gradients are never averaged."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class NoBroadcast(DDP):
    """Averages gradients, but never broadcasts rank zero's initial parameters (``init_sync=False``)."""

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        return DistributedDataParallel(module, init_sync=False, broadcast_buffers=False)


class DroppingNoSync(DDP):
    """``no_sync`` that throws away the gradients accumulated inside it."""

    def no_sync(self, wrapped: torch.nn.Module, skip_gradient_sync: bool) -> ContextManager:
        return (
            _dropping(super().no_sync(wrapped, skip_gradient_sync), wrapped)
            if skip_gradient_sync
            else super().no_sync(wrapped, skip_gradient_sync)
        )


@contextlib.contextmanager
def _dropping(inner: ContextManager, wrapped: torch.nn.Module) -> Iterator[None]:
    with inner:
        yield
    for parameter in wrapped.parameters():
        parameter.grad = None


class ScaledAmp(MixedPrecision):
    """bf16 autocast with a GradScaler (loss scaling), unscaled before clipping as it must be."""

    def __init__(self) -> None:
        super().__init__("bfloat16", use_grad_scaler=True)


class ScaledAmpNoUnscale(ScaledAmp):
    """The same, but it forgets to unscale before clipping: clipping sees gradients 65536 times too large."""

    def unscale_gradients(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass


def _backend(strategy: Any, precision: Any) -> Any:
    return lambda args: TrainerBackend(strategy.from_arguments(args), precision())


register_backend("ddp-no-allreduce", _backend(NoAllReduce, FullPrecision), override=True)
register_backend("ddp-no-broadcast", _backend(NoBroadcast, FullPrecision), override=True)
register_backend("ddp-dropping-no-sync", _backend(DroppingNoSync, FullPrecision), override=True)
register_backend("sp-scaled-amp", _backend(SingleProcess, ScaledAmp), override=True)
register_backend("sp-scaled-amp-no-unscale", _backend(SingleProcess, ScaledAmpNoUnscale), override=True)
