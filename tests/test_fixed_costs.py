"""The fixed costs of a run stay cut (issue 53; measured by ``benchmarks/fixed_cost.py``).

What a default run does not use is not imported; nothing runs in a child process while the run
trains; a save reads no checkpoint back.
"""

import json
import os
import subprocess
import sys
import time

import torch

from toy import ToyModule, toy_args

import framework.checkpoint.retention as retention
from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_FOR_A_DEFAULT_RUN = (
    "matplotlib",  # metrics.png is drawn by a process of its own, after training
    "yaml",  # config.yaml is written by framework/config/yaml_text.py; PyYAML only reads a config
    "fsspec",  # only for remote URLs: local paths go through os
    "safetensors",  # exports only
    "tensorboard",
    "torch.utils.tensorboard",
    "torch.distributed.checkpoint",  # fsdp and model-parallel checkpoints
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    *(  # the callbacks a run gets only when asked for (framework/callbacks/__init__.py loads them on first use)
        f"framework.callbacks.{name}"
        for name in ("early_stopping", "ema", "swa", "weight_averaging", "lr_monitor", "timer", "terminate_on_nan")
    ),
    "framework.callbacks.profiler",  # with TrainerArguments.profiler only
    "framework.callbacks.throughput",
    "framework.callbacks.gpu_peaks",
)


def _imported_by(program: str) -> list:
    """The modules a fresh process imports running ``program`` after ``import torch`` and one AdamW
    step (what a hand-written loop's first optimizer step imports: ``torch._dynamo`` and with it
    parts of ``torch.distributed``)."""
    before = (
        "import sys, torch; p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.zeros(1); torch.optim.AdamW([p]).step()\n"
        "before = set(sys.modules)"
    )
    listing = "print(sorted(set(sys.modules) - before))"
    result = subprocess.run(
        [sys.executable, "-c", f"{before}\n{program}\n{listing}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return eval(result.stdout.strip().splitlines()[-1])  # a list of module names printed by this test's child


def test_import_framework_leaves_what_a_default_run_does_not_use_unimported():
    """Kills: an eager import of an optional or unused package at ``import framework`` (e.g. PyYAML
    for config.yaml: 14 ms; fsspec for local paths: 30-110 ms with the garbage collection it set off)."""
    modules = _imported_by("import framework, backends")
    assert "framework.loop.trainer" in modules  # the import did happen
    imported = [name for name in NOT_FOR_A_DEFAULT_RUN if name in modules]
    assert imported == [], f"import framework imported {imported}"


def test_a_default_training_process_never_imports_them(tmp_path):
    """Kills: a default run importing them on first use (the plot drawn in the training process, a
    YAML library for config.yaml, fsspec for a local output_dir, DCP for a single-process save)."""
    program = (
        "sys.path.insert(0, 'tests')\n"
        "from toy import ToyModule, toy_args\n"
        "from framework import Trainer\n"
        "from framework.checkpoint import DefaultCheckpointerArguments\n"
        f"args = toy_args({str(tmp_path)!r}, DefaultCheckpointerArguments(period=1), epochs=2, plot_metrics=True,"
        " sanity_val_steps=2, disable_tqdm=False)\n"
        "Trainer(ToyModule(), args).train()"
    )
    modules = _imported_by(program)
    assert os.path.isfile(tmp_path / "run" / "config.yaml") and os.listdir(tmp_path / "run" / "checkpoints")
    imported = [name for name in NOT_FOR_A_DEFAULT_RUN if name in modules]
    assert imported == [], f"a default sp run imported {imported}"


def _children() -> list:
    """This process's live child processes (Linux: every thread's ``children`` list)."""
    pids = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/children") as handle:
            pids += handle.read().split()
    return pids


def test_no_child_process_is_alive_while_the_run_trains(tmp_path):
    """Kills: any process started beside the training (issue 53: the drawing process started with
    training and imported matplotlib on a 2-core machine; a program training many times had 7 of
    them alive at once). At the defaults: plot, progress bar, checkpoints, validation. Processes that
    earlier tests left running (a drawing of theirs, a storage server) are not this run's."""
    from framework.metrics.background_plot import wait_for_plots

    wait_for_plots(timeout=120)
    before = set(_children())
    module = ToyModule()
    seen = []
    real_step = module.train_step

    def step(*arguments):
        seen.append(sorted(set(_children()) - before))
        return real_step(*arguments)

    module.train_step = step
    args = toy_args(tmp_path, DefaultCheckpointerArguments(period=1), epochs=3, plot_metrics=True, disable_tqdm=False)
    args.sanity_val_steps = 2
    Trainer(module, args).train()
    assert len(seen) == 3 * 8
    assert [pids for pids in seen if pids] == []
    assert wait_for_plots(timeout=120) == [str(tmp_path / "run" / "metrics.png")]  # the plot was drawn, after training


def test_saves_read_no_checkpoint_back(tmp_path, monkeypatch):
    """Kills: retention reading each checkpoint back to learn its run id (issue 53: 42 ``torch.load``
    calls in a run of 40 saves). Six saves, two kept: four deleted, none read."""
    loads = []
    real_load = torch.load

    def counting_load(*arguments, **kwargs):
        loads.append(arguments[0])
        return real_load(*arguments, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    trainer = Trainer(ToyModule(), toy_args(tmp_path, DefaultCheckpointerArguments(period=1, keep_last_n=2), epochs=6))
    trainer.train()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint-000000040.pt", "checkpoint-000000048.pt"]
    assert loads == []


def test_a_resumed_run_reads_the_checkpoint_it_resumes_from_once(tmp_path, monkeypatch):
    """Kills: a resumed run (a fresh process: nothing remembered) reading the checkpoint it resumed
    from a second time, at its first save, to learn whose it is. It still reads the pickle of each
    older checkpoint of the directory once (memory-mapped: not the tensors), to keep its hands off
    other runs' files: here 16 and 8, so 3 loads in all (docs/benchmarks.md, "Fixed costs")."""
    checkpoints = DefaultCheckpointerArguments(period=1, keep_last_n=3, resume="auto")
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, checkpoints, epochs=3)).train()
    monkeypatch.setattr(retention, "_RUN_IDS", {})  # what a fresh process knows
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *arguments, **kwargs: loads.append(arguments) or real_load(*arguments, **kwargs))
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, checkpoints, epochs=6))
    trainer.train()
    assert trainer.global_steps_finished == 48
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [
        "checkpoint-000000032.pt",
        "checkpoint-000000040.pt",
        "checkpoint-000000048.pt",
    ]
    assert len(loads) == 3  # checkpoint-24 (restored), then 16 and 8 once each; 8 is then deleted


def test_the_part_timer_counts_nested_parts_once():
    """Kills: a breakdown whose parts add up to more than the run (a save inside an epoch end counted
    in both)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fixed_cost import PartTimer

    class Work:
        def inner(self):
            time.sleep(0.05)

        def outer(self):
            time.sleep(0.05)
            self.inner()

        def untimed(self):
            return "ok"

    timer, work = PartTimer(), Work()
    timer.wrap(work, "inner", lambda *_: "inner")
    timer.wrap(work, "outer", lambda *_: "outer")
    timer.wrap(work, "untimed", lambda *_: "")
    started = time.perf_counter()
    work.outer()
    elapsed = time.perf_counter() - started
    assert work.untimed() == "ok" and "" not in timer.seconds
    assert timer.calls == {"outer": 1, "inner": 1}
    assert 0.05 <= timer.seconds["inner"] < 0.1 and 0.05 <= timer.seconds["outer"] < 0.1
    assert timer.seconds["inner"] + timer.seconds["outer"] <= elapsed


def test_the_framework_child_reports_every_part_of_its_run(tmp_path):
    """Kills: a part of ``train()`` the breakdown stops timing (a method renamed or no longer called:
    its row would read 0 and its time land in "the rest"), and a first step marked outside training."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fixed_cost import PARTS

    command = [sys.executable, "benchmarks/fixed_cost.py", "--child", "framework", "--backend", "sp", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "rank0.json") as handle:
        marks = json.load(handle)
    parts = {key[5:]: value for key, value in marks.items() if key.startswith("part:")}
    measured_in_the_child = [part for part in PARTS if part != "process exit (plot join, teardown)"]
    assert sorted(parts) == sorted(measured_in_the_child)
    assert [part for part in measured_in_the_child if not parts[part] > 0] == []
    assert parts["import framework"] > 0.01  # ~175 modules, timed from the first framework import of the process
    assert marks["script_start"] < marks["imported"] < marks["train_start"] < marks["first_step"] < marks["train_end"]
    inside = sum(parts[part] for part in measured_in_the_child[3:])
    assert abs(inside - marks["train_seconds"]) < 1e-6


def test_the_hand_written_child_never_imports_the_framework(tmp_path):
    """Kills: the hand-written loop paying the framework's import (through a shared benchmark helper)."""
    command = [sys.executable, "benchmarks/fixed_cost.py", "--child", "raw", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "rank0.json") as handle:
        marks = json.load(handle)
    assert marks["framework_imported"] == 0.0
    assert marks["script_start"] < marks["imported"] < marks["train_start"] < marks["first_step"] < marks["train_end"]


def test_the_drawing_runs_at_the_programs_priority_until_a_next_run_trains(tmp_path, monkeypatch):
    """Kills: the drawing at ``nice`` +10 from its start (a program that ends waits for it at exit:
    8-24 s at load 15-25, issue 53), and a next run that trains beside it at equal priority."""
    import framework.metrics.background_plot as background

    ready = tmp_path / "drawing-ready"  # written by the drawing process once its own start-up is done
    monkeypatch.setenv("FIXED_COSTS_TEST_READY", str(ready))
    waits = "open(os.environ['FIXED_COSTS_TEST_READY'], 'w').close(); import time; time.sleep(60)\n"
    sleeping = background.WORKER.replace("spec = importlib", waits + "spec = importlib", 1)
    assert sleeping != background.WORKER
    monkeypatch.setattr(background, "WORKER", sleeping)  # the real worker's start, then a drawing that outlasts the checks
    Trainer(ToyModule(), toy_args(tmp_path / "first", plot_metrics=True)).train()
    with background._pending_lock:
        (drawing,) = background._pending.values()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    pid, own = drawing._process.pid, os.getpriority(os.PRIO_PROCESS, 0)
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == own
        module, seen = ToyModule(), []
        real_step = module.train_step

        def step(*arguments):
            seen.append(os.getpriority(os.PRIO_PROCESS, pid))
            return real_step(*arguments)

        module.train_step = step
        Trainer(module, toy_args(tmp_path / "second", plot_metrics=False)).train()
        assert seen and set(seen) == {max(10, own)}
    finally:
        drawing._process.kill()
        drawing.wait(timeout=60)
