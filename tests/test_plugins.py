"""Backend plugins: @register_backend, entry points in a real (tiny) package, instances."""

import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from toy import ToyModule

import backends.registry as registry
from backends import (
    DDP,
    FullPrecision,
    MixedPrecision,
    SingleProcess,
    TrainerBackend,
    available_backends,
    build_backend,
    register_backend,
)
from framework import Trainer, TrainerArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT_INS = ["ddp", "ddp-amp", "ddp-bf16", "fsdp", "fsdp-amp", "fsdp-bf16"]
BUILT_INS += ["model-parallel", "model-parallel-amp", "model-parallel-bf16", "sp", "sp-amp", "sp-bf16"]
INSTALLED = sorted(set(available_backends()) - set(BUILT_INS))  # plugins installed here: the tests pass beside any

PLUGIN_SOURCE = '''
"""A tiny third-party backend package, found through its entry points."""
from backends import FullPrecision, SingleProcess, TrainerBackend


class StepCountingBackend(TrainerBackend):
    def __init__(self):
        super().__init__(SingleProcess(), FullPrecision())
        self.optimizer_steps = 0

    def step_optimizers(self, optimizers, closure=None):
        self.optimizer_steps += 1
        return super().step_optimizers(optimizers, closure)
'''

ENTRY_POINTS = """
[framework.backends]
step-counting = my_plugin:StepCountingBackend
broken-plugin = my_plugin_that_does_not_exist:Backend
sp = my_plugin:StepCountingBackend
"""


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Every test starts from the built-ins (plus installed plugins) and leaves them so."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_entry_points_loaded", registry._entry_points_loaded)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A pip-free installed package: ``my_plugin/`` plus ``my_plugin-0.1.dist-info/``."""
    package = tmp_path / "my_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(PLUGIN_SOURCE)
    dist_info = tmp_path / "my_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_plugin", None)


def _args(**overrides) -> TrainerArguments:
    values = dict(
        epochs=1, train_batch_size=64, disable_tqdm=True, log_level="WARNING", output_dir=tempfile.mkdtemp(prefix="plugins-")
    )
    values.update(overrides)
    values.setdefault("checkpointer_args", {"period": 0, "save_at_end": False})
    return TrainerArguments(**values)


def test_register_subclass_and_factory_then_select_by_name():
    @register_backend("sp-subclass")
    class SubclassBackend(TrainerBackend):
        def __init__(self):
            super().__init__(SingleProcess(), MixedPrecision("bfloat16"))

    @register_backend("sp-factory")
    def factory() -> TrainerBackend:
        return TrainerBackend(SingleProcess(), FullPrecision())

    assert available_backends() == sorted([*BUILT_INS, *INSTALLED, "sp-factory", "sp-subclass"])
    assert type(build_backend("sp-subclass")) is SubclassBackend
    assert build_backend("sp-factory") is not build_backend("sp-factory")  # a new instance each time
    trainer = Trainer(ToyModule(), _args(backend="sp-subclass"))
    trainer.train()
    assert isinstance(trainer.backend, SubclassBackend)
    assert isinstance(trainer.backend.precision, MixedPrecision)


def test_taken_name_is_an_error_unless_override():
    class Replacement(TrainerBackend):
        pass

    with pytest.raises(ValueError, match="backend name 'sp' is already registered; pass override=True"):
        register_backend("sp", Replacement)
    assert type(build_backend("sp")) is TrainerBackend
    register_backend("sp", Replacement, override=True)
    assert type(build_backend("sp")) is Replacement
    register_backend("sp", Replacement)  # the same object again is not a conflict


def test_unknown_name_lists_the_known_names():
    message = f"unknown backend 'dpp'; available backends: {', '.join(sorted([*BUILT_INS, *INSTALLED]))}"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_backend("dpp")
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(ToyModule(), _args(backend="dpp"))


def test_invalid_registrations_are_refused():
    with pytest.raises(TypeError, match="'not-a-backend' must be a TrainerBackend subclass"):
        register_backend("not-a-backend", dict)
    with pytest.raises(ValueError, match="non-empty string"):
        register_backend("", TrainerBackend)
    register_backend("returns-wrong-type", lambda: "sp")
    with pytest.raises(TypeError, match="factory for 'returns-wrong-type' returned str, not a TrainerBackend"):
        build_backend("returns-wrong-type")
    with pytest.raises(TypeError, match=re.escape("strategy must be a backends.Strategy")):
        TrainerBackend("ddp")
    registry.unregister_backend("returns-wrong-type")
    assert "returns-wrong-type" not in available_backends()
    with pytest.raises(ValueError, match="'returns-wrong-type' is not registered"):
        registry.unregister_backend("returns-wrong-type")


def test_trainer_accepts_a_backend_instance():
    class Recording(TrainerBackend):
        def __init__(self):
            super().__init__(DDP(), FullPrecision())  # DDP without torchrun: one process
            self.forwards = 0

        def forward(self, runner, *args):
            self.forwards += 1
            return super().forward(runner, *args)

    backend = Recording()
    trainer = Trainer(ToyModule(val_loaders=0), _args(backend="does-not-matter"), trainer_backend=backend)
    trainer.train()
    assert trainer.backend is backend
    assert backend.forwards == 4  # 256 samples / 64
    with pytest.raises(TypeError, match="trainer_backend must be a TrainerBackend, got str"):
        Trainer(ToyModule(), _args(), trainer_backend="sp")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_entry_point_package_is_found_and_selected_by_name(plugin_dir):
    capture = _Capture()
    log = logging.getLogger("backends.registry")
    old_level = log.level
    log.addHandler(capture)
    log.setLevel(logging.WARNING)
    try:
        registry.reload_entry_points()
    finally:
        log.removeHandler(capture)
        log.setLevel(old_level)
    assert available_backends() == sorted([*BUILT_INS, *INSTALLED, "step-counting"])
    # The broken entry point and the one claiming 'sp' are reported, not fatal.
    assert any("'broken-plugin'" in message and "failed to load" in message for message in capture.messages)
    assert any("'sp'" in message and "already registered" in message for message in capture.messages)
    assert type(build_backend("sp")) is TrainerBackend

    trainer = Trainer(ToyModule(), _args(backend="step-counting"))
    trainer.train()
    assert type(trainer.backend).__name__ == "StepCountingBackend"
    assert type(trainer.backend).__module__ == "my_plugin"
    assert trainer.backend.optimizer_steps == trainer.global_steps_finished == 4


FRESH_PROCESS = """
import sys
import backends
assert "my_plugin" not in sys.modules, "entry points must load lazily"
sys.path.insert(0, {tests!r})
from toy import ToyModule
from framework import Trainer, TrainerArguments
trainer = Trainer(ToyModule(), TrainerArguments(backend="step-counting", disable_tqdm=True, log_level="ERROR",
                                                output_dir={out!r}))
trainer.train()
print("backend", type(trainer.backend).__name__, "steps", trainer.backend.optimizer_steps)
"""


def test_entry_point_is_discovered_at_first_lookup_in_a_fresh_process(plugin_dir):
    script = FRESH_PROCESS.format(tests=os.path.join(ROOT, "tests"), out=str(plugin_dir / "out"))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_dir), ROOT]), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "backend StepCountingBackend steps 8" in result.stdout


def _docs_example() -> str:
    with open(os.path.join(ROOT, "docs", "backends.md")) as handle:
        text = handle.read()
    after_marker = text.split("<!-- tested: tests/test_plugins.py -->", 1)[1]
    return textwrap.dedent(after_marker.split("```python\n", 1)[1].split("```", 1)[0])


def test_docs_example_backend():
    namespace = {}
    exec(compile(_docs_example(), "docs/backends.md", "exec"), namespace)
    assert "ddp-gradnorm" in available_backends()
    args = _args(backend="ddp-gradnorm", track_grad_norm=True, clip_grads=True, max_grad_norm=0.5, log_every_n_steps=1)
    trainer = Trainer(ToyModule(), args)
    history = trainer.train()
    assert type(trainer.backend) is namespace["GradNormBackend"]
    recorded = [float(norm) for norm in trainer.backend.grad_norms]
    tracked = [record["value"] for record in history.records if record["name"] == "grad_norm"]
    assert len(recorded) == trainer.global_steps_finished == 4
    assert recorded == pytest.approx(tracked, rel=1e-6)
    assert max(recorded) > 0.5  # recorded before clipping


def test_a_call_overridden_on_the_backend_strategy_or_precision_is_made_every_step_the_rest_plainly(tmp_path):
    """The loop makes plain calls itself (``TrainerBackend.is_plain``); an override anywhere is called."""
    import contextlib

    calls = {"backward": 0, "no_sync": 0, "unscale_gradients": 0}

    class CountingPrecision(FullPrecision):
        def backward(self, loss, *args, **kwargs):
            calls["backward"] += 1
            super().backward(loss, *args, **kwargs)

    class CountingStrategy(SingleProcess):
        def no_sync(self, wrapped, skip_gradient_sync):
            calls["no_sync"] += 1
            return contextlib.nullcontext()

    class CountingBackend(TrainerBackend):
        def unscale_gradients(self, optimizers):
            calls["unscale_gradients"] += 1

    backend = CountingBackend(CountingStrategy(), CountingPrecision())
    assert [backend.is_plain(c) for c in ("no_sync", "backward", "unscale_gradients", "step_optimizers")] == [
        False,
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError, match=r"is_plain\('forward'\).*'backward'.*'no_sync'.*'step_optimizers'.*'unscale_gradients'"):
        backend.is_plain("forward")
    register_backend("counting", lambda args: CountingBackend(CountingStrategy(), CountingPrecision()))
    args = TrainerArguments(epochs=1, train_batch_size=16, backend="counting", output_dir=str(tmp_path), disable_tqdm=True)
    trainer = Trainer(ToyModule(n_train=64), args)
    trainer.train()
    assert trainer.global_steps_finished == 4
    assert calls == {"backward": 4, "no_sync": 4, "unscale_gradients": 4}
