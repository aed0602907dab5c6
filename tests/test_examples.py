"""The README's main example trains to the promised accuracy with its default config."""

import os
import runpy
import sys

import torch

import framework.checkpoint.safe_types  # noqa: F401 - numpy and random states in weights_only loading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_digits_example_default_config_reaches_95_percent(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        run = runpy.run_path(os.path.join(ROOT, "examples", "run.py"))
        accuracy = run["main"](["--trainer.output_dir", str(tmp_path), "--trainer.disable_tqdm", "true"])
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert accuracy >= 0.95
    assert "final val_accuracy=" in capsys.readouterr().out
    with open(os.path.join(ROOT, "README.md")) as handle:  # the README quotes what the example prints (torch 2.13 CPU)
        assert f"`final val_accuracy={accuracy:.4f}`" in handle.read()
    assert (tmp_path / "metrics.csv").exists() and (tmp_path / "config.yaml").exists()
    # digits.yaml: 10 epochs of 23 steps, a checkpoint every 5 epochs, keep the last 2.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint-000000115.pt", "checkpoint-000000230.pt"]


def test_digits_example_stopped_before_any_validation_still_reports_accuracy(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        run = runpy.run_path(os.path.join(ROOT, "examples", "run.py"))
        accuracy = run["main"](
            ["--trainer.output_dir", str(tmp_path), "--trainer.disable_tqdm", "true", "--trainer.max_steps", "3"]
        )
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert 0.0 <= accuracy <= 1.0
    assert f"final val_accuracy={accuracy:.4f}" in capsys.readouterr().out


def test_gan_example_trains_with_manual_optimization(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        run = runpy.run_path(os.path.join(ROOT, "examples", "gan.py"))
        loss = run["main"](["--trainer.output_dir", str(tmp_path), "--trainer.disable_tqdm", "true", "--trainer.epochs", "2"])
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert 0.3 < loss < 0.9  # neither side has won: the discriminator is near chance (log 2 ~ 0.69)
    assert "final generator_loss=" in capsys.readouterr().out
    assert (tmp_path / "checkpoints").is_dir()


def test_dqn_example_plays_into_its_buffer_and_trains(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        run = runpy.run_path(os.path.join(ROOT, "examples", "dqn.py"))
        loss = run["main"](["--trainer.output_dir", str(tmp_path), "--trainer.disable_tqdm", "true", "--trainer.epochs", "2"])
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert 0.0 < loss < 1.0  # mean squared TD error of rewards in [-0.01, 1]
    assert "final train_loss_epoch=" in capsys.readouterr().out
    state = torch.load(tmp_path / "checkpoints" / "checkpoint-000000008.pt", weights_only=True)
    buffer = state["trainer"]["ranks"][0]["module"]["buffer"]
    assert buffer["size"] == 32 + 8  # the warm-up, then one environment step per train step
