"""Backend options reach a backend one way, through constructors: registry factories receive the
run's arguments, zero-argument plugin factories keep working, and an option that would be lost
(one the backend does not take, or one a trainer_backend instance was built without) is an error."""

import dataclasses
import logging
from typing import ClassVar

import pytest
import torch

from toy import ToyModule, toy_args

from backends import (
    DDP,
    FSDP,
    BackendOption,
    FullPrecision,
    MixedPrecision,
    SingleProcess,
    TrainerBackend,
    build_backend,
    register_backend,
    registry,
)
from framework import Trainer, TrainerArguments
from framework.config.cli import ConfigError, parse_config


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


# A plugin's own options: declared at registration, set in TrainerArguments.backend_options.

TUNED_OPTIONS = {
    "bucket_cap_mb": (25, "DDP bucket size in MB"),
    "static_graph": BackendOption(False, "the graph is the same every step"),
    "mode": BackendOption("fast", "how it runs", choices=("fast", "safe")),
}


def _register_tuned(name: str = "ddp-tuned") -> list:
    seen = []

    def factory(args, bucket_cap_mb, static_graph, mode):
        seen.append({"bucket_cap_mb": bucket_cap_mb, "static_graph": static_graph, "mode": mode})
        wrap = {"bucket_cap_mb": bucket_cap_mb, "static_graph": static_graph}
        return TrainerBackend(DDP.from_arguments(args).with_wrap_options(**wrap), FullPrecision())

    register_backend(name, factory, options=TUNED_OPTIONS)
    return seen


def test_a_plugins_options_reach_its_factory_from_code_yaml_and_the_command_line(tmp_path, capsys):
    seen = _register_tuned()
    backend = build_backend("ddp-tuned", TrainerArguments(backend_options={"bucket_cap_mb": 50}))
    assert seen.pop() == {"bucket_cap_mb": 50, "static_graph": False, "mode": "fast"}  # the rest at their defaults
    assert backend.strategy.wrap_options == {"bucket_cap_mb": 50, "static_graph": False}
    build_backend("ddp-tuned")
    assert seen.pop() == {"bucket_cap_mb": 25, "static_graph": False, "mode": "fast"}

    argv = ["--backend", "ddp-tuned", "--trainer.backend_options.bucket_cap_mb", "50", "--backend_options.static_graph"]
    assert parse_config(argv=argv).trainer.backend_options == {"bucket_cap_mb": 50, "static_graph": True, "mode": "fast"}
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  backend: ddp-tuned\n  backend_options:\n    mode: safe\n    bucket_cap_mb: 10\n")
    parsed = parse_config(argv=["--config", str(config), "--trainer.backend_options.bucket_cap_mb", "40"])
    assert parsed.trainer.backend_options == {"bucket_cap_mb": 40, "static_graph": False, "mode": "safe"}  # CLI wins
    config.write_text("backend: ddp-tuned\nbackend_options:\n  static_graph: true\n")  # top-level, as --backend
    assert parse_config(argv=["--config", str(config)]).trainer.backend_options["static_graph"] is True
    assert parse_config(argv=[]).trainer.backend_options == {}  # sp declares none

    trainer = Trainer(ToyModule(), toy_args(tmp_path, backend="ddp-tuned", use_gpu=False, backend_options={"mode": "safe"}))
    assert seen.pop()["mode"] == "safe" and trainer.backend.strategy.wrap_options["bucket_cap_mb"] == 25
    trainer.backend.teardown()

    with pytest.raises(SystemExit):  # the resolved config, as --config loads it
        parse_config(argv=["--backend", "ddp-tuned", "--backend_options.bucket_cap_mb", "50", "--print_config"])
    printed = capsys.readouterr().out
    assert "  backend_options:\n    bucket_cap_mb: 50\n    static_graph: false\n    mode: fast\n" in printed
    config.write_text(printed)
    assert parse_config(argv=["--config", str(config)]).trainer.backend_options["bucket_cap_mb"] == 50


def test_a_mistyped_or_foreign_plugin_option_is_refused_with_what_is_allowed(tmp_path):
    _register_tuned()
    _register_tuned("ddp-tuned-amp")
    with pytest.raises(
        ValueError,
        match=r"backend_options.bucket_cap=50 is not an option of backend 'ddp-tuned'; did you mean 'bucket_cap_mb'\? "
        r"allowed: bucket_cap_mb, static_graph, mode",
    ):
        build_backend("ddp-tuned", TrainerArguments(backend_options={"bucket_cap": 50}))
    with pytest.raises(
        ValueError,
        match=r"backend_options.bucket_cap_mb=50 does not apply to backend 'ddp': it declares no backend_options "
        r"\('bucket_cap_mb' is an option of [^)]*'ddp-tuned', 'ddp-tuned-amp'",  # and any installed plugin's
    ):
        Trainer(ToyModule(), toy_args(tmp_path, backend="ddp", backend_options={"bucket_cap_mb": 50}))
    with pytest.raises(ValueError, match=r"backend_options.mode='quick' is invalid for backend 'ddp-tuned'; allowed: one of"):
        build_backend("ddp-tuned", TrainerArguments(backend_options={"mode": "quick"}))
    with pytest.raises(ValueError, match=r"backend_options.static_graph=1 is invalid .* allowed: bool \(default False\)"):
        build_backend("ddp-tuned", TrainerArguments(backend_options={"static_graph": 1}))
    # Another backend's option at that backend's default means "not set" (a saved config run with --backend ddp).
    assert type(build_backend("ddp", TrainerArguments(backend_options={"bucket_cap_mb": 25})).strategy) is DDP
    # The config reports every mistake at once, each with where it was given.
    argv = ["--backend", "ddp-tuned", "--backend_options.bucket_cap", "5", "--backend_options.mode", "quick"]
    with pytest.raises(ConfigError, match=r"2 config errors:\n.*did you mean 'bucket_cap_mb'.*\(from command line\)\n.*'quick'"):
        parse_config(argv=argv)
    with pytest.raises(ValueError, match=r"backend_options=\{'bucket_cap_mb': 50\} does not reach the trainer_backend instance"):
        Trainer(ToyModule(), toy_args(tmp_path, backend_options={"bucket_cap_mb": 50}), trainer_backend=TrainerBackend(DDP()))
    with pytest.raises(ValueError, match=r"TrainerArguments.backend_options=\['bucket_cap_mb'\] is invalid; allowed: a dict"):
        TrainerArguments(backend_options=["bucket_cap_mb"])


def test_declarations_are_checked_when_the_plugin_registers():
    with pytest.raises(ValueError, match=r"declares option 'compile', which is a built-in backend option \(TrainerArguments"):
        register_backend("bad", lambda args, compile: TrainerBackend(), options={"compile": False})
    with pytest.raises(ValueError, match=r"declares option 'bucket-cap'; allowed: a Python identifier"):
        register_backend("bad", lambda args, **options: TrainerBackend(), options={"bucket-cap": 1})
    with pytest.raises(TypeError, match=r"declares the options bucket_cap_mb, which its factory receives as keyword"):
        register_backend("bad", lambda args: TrainerBackend(), options={"bucket_cap_mb": 25})
    assert "bad" not in registry.available_backends()

    class Declared(TrainerBackend):  # an entry-point plugin declares them on its class
        declared_options: ClassVar[dict] = {"bucket_cap_mb": (25, "DDP bucket size in MB")}

        def __init__(self, args=None, bucket_cap_mb=25):
            super().__init__(DDP.from_arguments(args).with_wrap_options(bucket_cap_mb=bucket_cap_mb))

    register_backend("declared", Declared)
    assert registry.declared_options("declared")["bucket_cap_mb"].help == "DDP bucket size in MB"
    assert build_backend("declared", TrainerArguments(backend_options={"bucket_cap_mb": 5})).strategy.wrap_options == {
        "bucket_cap_mb": 5
    }


def test_help_lists_each_plugins_options_under_the_backends_that_declare_them(capsys):
    _register_tuned()
    _register_tuned("ddp-tuned-amp")
    with pytest.raises(SystemExit):
        parse_config(argv=["--backend", "ddp-tuned", "--backend_options.bucket_cap_mb", "50", "--help"])
    text = capsys.readouterr().out
    group = text[text.index("\n  ddp-tuned, ddp-tuned-amp:\n", text.index("\ntrainer.backend_options:")) + 1 :]
    assert group.splitlines()[:7] == [
        "  ddp-tuned, ddp-tuned-amp:",
        "    --trainer.backend_options.bucket_cap_mb (int, default 25; this run: 50)",
        "        DDP bucket size in MB",
        "    --trainer.backend_options.static_graph (bool, default False)",
        "        the graph is the same every step",
        "    --trainer.backend_options.mode (str, one of ['fast', 'safe'], default 'fast')",
        "        how it runs",
    ]


def test_ddp_wrap_options_the_strategy_controls_or_torch_lacks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'device_ids' cannot be set here: the strategy places each rank on its device"):
        DDP(wrap_options={"device_ids": [0]})
    with pytest.raises(ValueError, match=r"'process_group' cannot be set here: the strategy creates, owns"):
        DDP().with_wrap_options(process_group=None)
    with pytest.raises(ValueError, match=r"'find_unused_parameters' cannot be set here: it has its own option"):
        DDP(wrap_options={"find_unused_parameters": True})
    with pytest.raises(ValueError, match=r"'bucket_cap' is not a DistributedDataParallel parameter; did you mean 'bucket_cap_mb"):
        DDP(wrap_options={"bucket_cap": 50})
    with pytest.raises(ValueError, match=r"FSDP.with_wrap_options\(\): FSDP shards parameters; it never wraps"):
        FSDP.from_arguments(None).with_wrap_options(bucket_cap_mb=50)

    class Overriding(DDP):
        def ddp_kwargs(self, module):
            return {**super().ddp_kwargs(module), "output_device": 0}

    strategy = Overriding(use_gpu=False)
    strategy.setup()  # one process: the override is still checked when the module is wrapped
    with pytest.raises(ValueError, match=r"Overriding.ddp_kwargs\(\): 'output_device' cannot be set here"):
        strategy.wrap_module(torch.nn.Linear(2, 2))
