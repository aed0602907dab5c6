"""Backend options reach a backend one way, through constructors: registry factories receive the
run's arguments, zero-argument plugin factories keep working, and an option that would be lost
(one the backend does not take, or one a trainer_backend instance was built without) is an error."""

import dataclasses
import logging

import pytest

from toy import ToyModule, toy_args

from backends import (
    DDP,
    FSDP,
    FullPrecision,
    MixedPrecision,
    SingleProcess,
    TrainerBackend,
    build_backend,
    register_backend,
    registry,
)
from framework import Trainer, TrainerArguments
from framework.run.config import parse_config


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_entry_points_loaded", registry._entry_points_loaded)


class _Records(logging.Handler):
    """A handler on the logger itself: after a Trainer ran, backends loggers stop propagating."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.WARNING)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_fsdp_reshard_after_forward_from_the_arguments_reaches_the_strategy(tmp_path):
    assert parse_config(argv=["--trainer.reshard_after_forward", "false"]).trainer.reshard_after_forward is False
    trainer = Trainer(ToyModule(), toy_args(tmp_path, backend="fsdp", reshard_after_forward=False, use_gpu=False))
    assert isinstance(trainer.backend.strategy, FSDP)
    assert trainer.backend.strategy.reshard_after_forward is False
    assert trainer.backend.options["reshard_after_forward"] is False
    assert build_backend("fsdp-amp").strategy.reshard_after_forward is True  # no arguments: the defaults


def test_every_option_reaches_the_constructors():
    args = TrainerArguments(find_unused_parameters=True, ddp_timeout=30.0, use_gpu=False, compile=True, cluster="local")
    backend = build_backend("ddp-amp", dataclasses.replace(args, amp_dtype="bfloat16"))
    strategy = backend.strategy
    assert (strategy.find_unused_parameters, strategy.timeout_seconds, strategy.use_gpu, strategy.compile) == (
        True,
        30.0,
        False,
        True,
    )
    assert strategy.cluster == "local" and backend.precision.requested_dtype == "bfloat16"
    backend.setup()  # takes no options
    assert backend.cluster_environment.name == "local"
    backend.teardown()


def test_a_registered_factory_receives_the_arguments():
    seen = []

    def factory(args):
        seen.append(args)
        return TrainerBackend(SingleProcess.from_arguments(args), FullPrecision())

    register_backend("sp-recording", factory)
    args = TrainerArguments(backend="sp-recording", use_gpu=False)
    assert build_backend("sp-recording", args).strategy.use_gpu is False
    assert seen == [args]

    @register_backend("sp-subclass-with-args")
    class WithArguments(TrainerBackend):
        def __init__(self, args=None):
            super().__init__(SingleProcess.from_arguments(args), MixedPrecision.from_arguments(args))

    backend = build_backend("sp-subclass-with-args", TrainerArguments(amp_dtype="bfloat16", compile=True))
    assert backend.options == {"use_gpu": None, "cluster": None, "compile": True, "amp_dtype": "bfloat16"}


def test_zero_argument_plugin_factories_still_work(tmp_path):
    class NoInit(TrainerBackend):
        pass

    class OwnInit(TrainerBackend):
        def __init__(self):
            super().__init__(SingleProcess(use_gpu=False), FullPrecision())

    register_backend("legacy-lambda", lambda: TrainerBackend(SingleProcess(), FullPrecision()))
    register_backend("legacy-class", NoInit)
    register_backend("legacy-own-init", OwnInit)
    for name, kind in (("legacy-lambda", TrainerBackend), ("legacy-class", NoInit), ("legacy-own-init", OwnInit)):
        assert type(build_backend(name)) is kind
        assert type(build_backend(name, TrainerArguments())) is kind
    trainer = Trainer(ToyModule(val_loaders=0), toy_args(tmp_path, backend="legacy-own-init", use_gpu=False))
    trainer.train()
    assert type(trainer.backend) is OwnInit and trainer.global_steps_finished > 0
    # An option the factory cannot receive is not dropped silently: a warning names it.
    with _Records("backends.options") as messages:
        build_backend("legacy-lambda", TrainerArguments(compile=True))
    assert any("compile=True" in message and "takes no arguments" in message for message in messages), messages


def test_an_option_the_backend_does_not_use_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"find_unused_parameters=True does not apply to backend 'sp'.*ddp, ddp-amp, ddp-bf16"):
        Trainer(ToyModule(), toy_args(tmp_path, backend="sp", find_unused_parameters=True))
    with pytest.raises(ValueError, match=r"find_unused_parameters=True does not apply to backend 'fsdp'"):
        build_backend("fsdp", TrainerArguments(find_unused_parameters=True))
    with pytest.raises(ValueError, match=r"reshard_after_forward=False does not apply to backend 'ddp'.*fsdp and model-parallel"):
        build_backend("ddp", TrainerArguments(reshard_after_forward=False))
    with pytest.raises(ValueError, match=r"amp_dtype='bfloat16' does not apply to backend 'sp'.*allowed: amp_dtype=None"):
        build_backend("sp", TrainerArguments(amp_dtype="bfloat16"))
    with pytest.raises(TypeError, match="find_unused_parameters"):
        SingleProcess(find_unused_parameters=True)  # type: ignore[call-arg]
    # Documented no-op: a single process never waits for another rank.
    assert build_backend("sp", TrainerArguments(ddp_timeout=30.0)).options.get("ddp_timeout") is None


def test_an_instance_keeps_its_options_and_refuses_contradicting_arguments(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"find_unused_parameters=True, but the trainer_backend instance .* was built with "
        r"find_unused_parameters=False.*DDP\(find_unused_parameters=\.\.\.\).*by name",
    ):
        Trainer(ToyModule(), toy_args(tmp_path, find_unused_parameters=True), trainer_backend=TrainerBackend(DDP()))
    with pytest.raises(ValueError, match=r"reshard_after_forward=False does not apply to the trainer_backend instance"):
        Trainer(ToyModule(), toy_args(tmp_path, reshard_after_forward=False), trainer_backend=TrainerBackend(DDP()))
    # Built with the option, the instance agrees with the arguments; defaults never conflict.
    backend = TrainerBackend(DDP(find_unused_parameters=True, timeout_seconds=30.0, use_gpu=False))
    trainer = Trainer(
        ToyModule(), toy_args(tmp_path / "ok", find_unused_parameters=True, ddp_timeout=30.0), trainer_backend=backend
    )
    assert trainer.backend is backend and backend.strategy.find_unused_parameters is True
