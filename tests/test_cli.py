"""Config mistakes on a real command line end with argparse's ``error: <message>`` and status 2, no traceback."""

import concurrent.futures
import os
import re
import subprocess
import sys

import pytest

from backends import available_backends
from framework.config.cli import ConfigError, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ", ".join(available_backends())  # the built-in ones: the example registers no plugin


def run(arguments, cwd):
    environment = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *arguments], cwd=cwd, env=environment, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory):
    """The selected ``examples/run.py`` argument lists started two at a time, each in its own process and
    directory (each stops at its first mistake): test id -> future."""
    selected = [
        item
        for item in request.session.items
        if item.parent is request.node and item.originalname == "test_the_example_reports_config_errors_like_argparse"
    ]
    example = os.path.join(ROOT, "examples", "run.py")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            item.callspec.id: pool.submit(run, [example, *item.callspec.params["argv"]], tmp_path_factory.mktemp("cli"))
            for item in selected
        }
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--trainer.epoch", "3"],
            "examples/run.py: error: unknown config key 'trainer.epoch' (from command line); did you mean 'trainer.epochs'?",
        ),
        (
            ["--trainer.epochs", "2.5"],
            "examples/run.py: error: trainer.epochs='2.5' (from command line): expected an integer, got '2.5'",
        ),
        (
            ["--trainer.epochs", "0"],
            "examples/run.py: error: section 'trainer': TrainerArguments.epochs=0 is invalid; allowed: an integer >= 1",
        ),
        (["--config", "missing.yaml"], "examples/run.py: error: config file 'missing.yaml' does not exist"),
        (
            ["--backend", "dpp"],
            "examples/run.py: error: trainer.backend='dpp' (from command line): unknown backend; did you mean 'ddp'? "
            f"available backends: {BACKENDS}",
        ),
    ],
)
def test_the_example_reports_config_errors_like_argparse(argv, message, example_runs, request):
    result = example_runs[request.node.callspec.id].result()
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "usage: examples/run.py [--config FILE.yaml] [--SECTION.FIELD VALUE ...] [--backend NAME]  (--help lists every field)",
        message,
    ]
    assert result.stdout == ""


def test_parse_config_on_sys_argv_exits_and_with_explicit_argv_raises(tmp_path):
    script = "from framework.config.cli import parse_config\nparse_config(program='train.py')\nprint('parsed')\n"
    (tmp_path / "train.py").write_text(script)
    bad = run(["train.py", "--trainer.max_steps", "many"], cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert (
        bad.stderr.splitlines()[-1]
        == "train.py: error: trainer.max_steps='many' (from command line): expected an integer, got 'many'"
    )
    good = run(["train.py", "--trainer.epochs", "3"], cwd=tmp_path)
    assert good.returncode == 0 and good.stdout == "parsed\n"
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'trainer.max_step'")):
        parse_config(argv=["--trainer.max_step", "3"])


def test_every_mistake_of_a_yaml_file_and_the_command_line_is_named_at_once(tmp_path):
    (tmp_path / "bad.yaml").write_text("trainer:\n  epoch: 3\n  seed: many\ncheckpointer:\n  keep_last: 2\n")
    result = run([os.path.join(ROOT, "examples", "run.py"), "--config", "bad.yaml", "--backend", "fsdp-bf17"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[1:] == [
        "examples/run.py: error: 4 config errors:",
        "  unknown config key 'trainer.epoch' (from bad.yaml); did you mean 'trainer.epochs'?",
        "  trainer.seed='many' (from bad.yaml): expected an integer, got 'many'",
        "  unknown config key 'checkpointer.keep_last' (from bad.yaml); did you mean 'checkpointer.keep_last_n'?",
        "  trainer.backend='fsdp-bf17' (from command line): unknown backend; did you mean 'fsdp-bf16'? "
        f"available backends: {BACKENDS}",
    ]


def test_a_directory_holding_another_run_is_one_line_and_a_failing_exit(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.csv").write_text("epoch,step,name,value\n0,1,train_loss,1.0\n")
    arguments = ["--trainer.output_dir", "taken", "--trainer.output_dir_in_use", "error", "--trainer.epochs", "1"]
    result = run([os.path.join(ROOT, "examples", "run.py"), *arguments], cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr and result.stdout == ""
    last = result.stderr.splitlines()[-1]
    assert last.startswith("examples/run.py: error: output_dir 'taken' already holds another run's files (metrics.csv)")
    assert "--checkpointer.resume auto" in last
