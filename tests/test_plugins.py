"""Backend plugins: @register_backend, entry points in a real (tiny) package, instances."""

import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from distributed import run_ranks
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
from framework.config.cli import parse_config

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


def _ddp_wrap_options_rank(rank, output_dir):
    """One rank: the same runs on plain ``ddp`` and on a plugin whose options tune DistributedDataParallel."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    wrapped = {}

    class RecordingDDP(DDP):
        def wrap_module(self, module):
            wrapped[self.tag] = super().wrap_module(module)
            return wrapped[self.tag]

    def strategy(args, tag):
        built = RecordingDDP.from_arguments(args)
        built.tag = tag
        return built

    def tuned(args, bucket_cap_mb, static_graph, bucket_view):
        wrap = dict(bucket_cap_mb=bucket_cap_mb, static_graph=static_graph, gradient_as_bucket_view=bucket_view)
        return TrainerBackend(strategy(args, args.output_dir.rsplit("/", 1)[1]).with_wrap_options(**wrap), FullPrecision())

    register_backend("ddp-recorded", lambda args: TrainerBackend(strategy(args, args.output_dir.rsplit("/", 1)[1])))
    register_backend("ddp-tuned", tuned, options={"bucket_cap_mb": 25, "static_graph": False, "bucket_view": False})

    def train(tag, backend, micro_batch, **options):
        args = TrainerArguments(
            epochs=2, train_batch_size=32, gpu_batch_size_limit=micro_batch, seed=0, use_gpu=False, disable_tqdm=True,
            log_level="WARNING", output_dir=f"{output_dir}/{tag}", backend=backend, backend_options=options,
            checkpointer_args={"period": 0, "save_at_end": False},
        )  # fmt: skip
        trainer = Trainer(ToyModule(n_train=128, scheduler=None), args)
        trainer.train()
        return torch.cat([p.detach().flatten() for p in trainer.module.parameters()]).tolist()

    weights = {
        "plain_accumulating": train("plain_accumulating", "ddp-recorded", 8),  # 2 micro-batches of 8 per rank and step
        "tuned_accumulating": train("tuned_accumulating", "ddp-tuned", 8, bucket_cap_mb=1, bucket_view=True),
        "plain": train("plain", "ddp-recorded", None),
        "static": train("static", "ddp-tuned", None, static_graph=True),
    }
    try:
        train("static_accumulating", "ddp-tuned", 8, static_graph=True)
        refused = ""
    except ValueError as error:
        refused = str(error)
    assert all(isinstance(module, DistributedDataParallel) for module in wrapped.values())
    return {
        "bucket_bytes": {tag: module.bucket_bytes_cap for tag, module in wrapped.items()},
        "static_graph": {tag: module.static_graph for tag, module in wrapped.items()},
        "bucket_view": {tag: module.gradient_as_bucket_view for tag, module in wrapped.items()},
        "weights": weights,
        "refused": refused,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_a_plugins_options_tune_distributed_data_parallel_on_two_ranks_and_training_stays_exact(tmp_path):
    """``DDP.with_wrap_options`` from a plugin's declared options reaches torch's wrapper (no copy of
    ``wrap_module``): buckets of 1 MB and gradients as bucket views under accumulation (``no_sync``),
    a static graph without; the weights equal plain ddp's bit for bit, on both ranks. A static graph
    with accumulation, which torch's reducer cannot run, is refused with the way out."""
    ranks = run_ranks(_ddp_wrap_options_rank, timeout=150, output_dir=str(tmp_path))
    mb = 1024 * 1024
    for result in ranks:
        assert result["bucket_bytes"] == {
            "plain_accumulating": 25 * mb,
            "tuned_accumulating": mb,
            "plain": 25 * mb,
            "static": 25 * mb,
            "static_accumulating": 25 * mb,
        }
        assert [tag for tag, on in result["bucket_view"].items() if on] == ["tuned_accumulating"]
        assert [tag for tag, on in result["static_graph"].items() if on] == ["static", "static_accumulating"]
        weights = result["weights"]
        assert weights["tuned_accumulating"] == weights["plain_accumulating"]
        assert weights["static"] == weights["plain"]
        assert "static_graph=True) (a DDP wrap option) cannot skip the gradient sync" in result["refused"]
    assert ranks[0]["weights"] == ranks[1]["weights"]


INSTALLED_PLUGIN = '''
"""A backend package installed the way pip installs one, found through its entry points."""
from backends import DDP, FullPrecision, TrainerBackend


class InstalledBackend(TrainerBackend):
    declared_options = {"bucket_cap_mb": (25, "DDP bucket size in MB")}

    def __init__(self, args=None, bucket_cap_mb=25):
        super().__init__(DDP.from_arguments(args).with_wrap_options(bucket_cap_mb=bucket_cap_mb), FullPrecision())
'''
LISTING_TESTS = "known_names or register_subclass_and_factory or entry_point_package or dpp or every_backend_is_in_the_table"
LISTING_TESTS += " or __init__"  # backends/__init__.py's doctest


@pytest.mark.slow
def test_the_tests_that_list_backends_pass_with_a_plugin_installed_and_its_options_show_in_help(tmp_path, monkeypatch, capsys):
    """A plugin in the user's site-packages (as ``pip install --user`` puts it: seen by every child
    process, whatever its PYTHONPATH), named to sort first and last, adds backends: the project's
    tests and doctests that list backends still pass, and ``--help`` shows its declared options."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_packages = tmp_path / "lib" / version / "site-packages"
    (site_packages / "installed_plugin").mkdir(parents=True)
    (site_packages / "installed_plugin" / "__init__.py").write_text(INSTALLED_PLUGIN)
    dist_info = site_packages / "installed_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: installed-plugin\nVersion: 0.1\n")
    names = ["aa-installed", "zz-installed"]
    (dist_info / "entry_points.txt").write_text(
        "[framework.backends]\n" + "".join(f"{name} = installed_plugin:InstalledBackend\n" for name in names)
    )
    monkeypatch.syspath_prepend(str(site_packages))  # here: --help reads the declarations from the entry point's class
    registry.reload_entry_points()
    try:
        with pytest.raises(SystemExit):
            parse_config(argv=["--help"])
    finally:
        sys.modules.pop("installed_plugin", None)
    help_text = capsys.readouterr().out
    assert "\n  aa-installed, zz-installed:\n    --trainer.backend_options.bucket_cap_mb (int, default 25)\n" in help_text

    environment = dict(os.environ, PYTHONUSERBASE=str(tmp_path), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    tests = ["backends/__init__.py", "tests/test_plugins.py", "tests/test_cli.py", "tests/test_docs.py"]
    arguments = ["--doctest-modules", "-p", "no:cacheprovider", "-q", "-k", LISTING_TESTS, *tests]
    script = (
        "import sys, backends, pytest; installed = [n for n in backends.available_backends() if 'installed' in n]; "
        f"assert installed == {names!r}, f'the plugin is not installed here: {{installed}}'; "
        f"sys.exit(pytest.main({arguments!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # python -s would hide the plugin
    assert "6 passed" in result.stdout, result.stdout[-3000:]
