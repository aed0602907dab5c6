"""python -m framework.metrics.plot: metrics.csv -> a PNG of training and validation curves."""

import os
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from framework.loggers import CSVLogger, RunInfo
from framework.metrics.plot import main, panel_of, plot_metrics, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(directory) -> str:
    """A metrics.csv as the trainer writes it: 3 epochs of 10 steps, two validation loaders."""
    records = []
    for epoch in range(3):
        for step in range(epoch * 10 + 2, epoch * 10 + 11, 2):
            records.append({"epoch": epoch, "step": step, "name": "train_loss", "value": 2.0 / step})
            records.append({"epoch": epoch, "step": step, "name": "lr", "value": 0.1 * (1 - step / 30)})
        end = epoch * 10 + 10
        records.append({"epoch": epoch, "step": end, "name": "train_loss_epoch", "value": 2.2 / end})
        for loader, offset in (("a", 0.05), ("b", 0.1)):
            records.append({"epoch": epoch, "step": end, "name": f"val_loss/{loader}", "value": 2.5 / end + offset})
        records.append({"epoch": epoch, "step": end, "name": "val_accuracy", "value": 0.5 + 0.1 * epoch})
    csv_logger = CSVLogger(os.path.join(directory, "metrics.csv"))
    csv_logger.start(RunInfo(directory, records=records))
    csv_logger.finish("FINISHED")
    return os.path.join(directory, "metrics.csv")


def test_panels_group_train_epoch_and_validation_curves_of_one_quantity():
    names = ["train_loss", "train_loss_epoch", "val_loss", "val_loss/a", "test_loss", "val_accuracy", "lr", "grad_norm"]
    assert [panel_of(name) for name in names] == ["loss"] * 5 + ["accuracy", "lr", "grad_norm"]


def test_read_metrics_returns_each_series_in_order(tmp_path):
    series = read_metrics(write_run(tmp_path))
    assert list(series) == ["train_loss", "lr", "train_loss_epoch", "val_loss/a", "val_loss/b", "val_accuracy"]
    assert series["val_accuracy"] == [(10, 0.5), (20, 0.6), (30, 0.7)]
    (tmp_path / "bad.csv").write_text("epoch,step,name\n0,1,x\n")
    with pytest.raises(ValueError, match=r"lacks the columns \['value'\]"):
        read_metrics(str(tmp_path / "bad.csv"))
    (tmp_path / "garbled.csv").write_text("epoch,step,name,value\n0,1,x,high\n")
    with pytest.raises(ValueError, match="line 2: cannot read step='1' value='high'"):
        read_metrics(str(tmp_path / "garbled.csv"))


def test_plot_writes_a_real_png_with_one_panel_per_quantity(tmp_path):
    write_run(tmp_path)
    path = plot_metrics(str(tmp_path))
    assert path == str(tmp_path / "metrics.png")
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width > 2 * height  # three panels side by side: loss, accuracy, lr
    assert np.std(image[..., :3]) > 0.05  # curves, not a blank canvas

    only_loss = plot_metrics(str(tmp_path / "metrics.csv"), output=str(tmp_path / "sub" / "loss.png"), panels=["loss"])
    height, width = matplotlib.image.imread(only_loss).shape[:2]
    assert width < 1.6 * height  # one panel
    with pytest.raises(ValueError, match=r"unknown panels \['acc'\]; this run has \['loss', 'accuracy', 'lr'\]"):
        plot_metrics(str(tmp_path), panels=["acc"])


def test_command_line_writes_the_png_and_reports_errors(tmp_path, capsys):
    write_run(tmp_path)
    output = str(tmp_path / "curves.png")
    assert main([str(tmp_path), "-o", output, "--metrics", "loss,accuracy"]) == output
    assert os.path.getsize(output) > 10_000 and f"wrote {output}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert f"no metrics file at {str(tmp_path / 'missing' / 'metrics.csv')!r}" in capsys.readouterr().err


def test_python_dash_m_framework_plot(tmp_path):
    write_run(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "framework.metrics.plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'metrics.png'}"
    assert matplotlib.image.imread(str(tmp_path / "metrics.png")).ndim == 3


def test_drawing_leaves_the_users_matplotlib_alone(tmp_path):
    """A notebook's backend and figures are not touched: the plot is a Figure of its own, drawn
    without pyplot (which the trainer used to import, switching the backend to Agg)."""
    write_run(tmp_path)
    program = (
        "import sys, matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt; mine = plt.figure(); "
        "from framework.metrics.plot import plot_metrics; plot_metrics(sys.argv[1]); "
        "print(matplotlib.get_backend(), plt.get_fignums(), plt.gcf() is mine)"
    )
    result = subprocess.run([sys.executable, "-c", program, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "[1]", "True"]
    assert matplotlib.image.imread(str(tmp_path / "metrics.png")).ndim == 3
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from framework.metrics.plot import plot_metrics; plot_metrics(sys.argv[1]); "
            "print('matplotlib.pyplot' in sys.modules)",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split() == ["False"], result.stderr


def test_a_run_draws_metrics_png_at_its_end_with_a_log_axis_for_losses(tmp_path, monkeypatch, framework_log):
    import matplotlib.figure

    from toy import ToyModule, toy_args

    from framework import Trainer
    from framework.callbacks import MetricsPlot
    from framework.callbacks.metrics_plot import plots_by_default

    scales = {}
    save = matplotlib.figure.Figure.savefig

    def savefig(figure, *args, **kwargs):  # read the axes the PNG is drawn from
        scales.update({axis.get_title(): axis.get_yscale() for axis in figure.axes if axis.get_visible()})
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    args = toy_args(tmp_path, epochs=2, log_every_n_steps=2, plot_metrics=True, log_level="INFO")
    trainer = Trainer(ToyModule(), args, callbacks=[MetricsPlot(background=False)])  # drawn here, seen by savefig
    trainer.train()
    png = tmp_path / "run" / "metrics.png"
    assert matplotlib.image.imread(str(png)).shape[2] in (3, 4)
    assert scales == {"loss": "log"}
    assert f"metrics plot: {png}" in framework_log

    # The default: on where matplotlib is installed, unless FRAMEWORK_PLOT_METRICS=0 (this suite sets it).
    monkeypatch.delenv("FRAMEWORK_PLOT_METRICS")
    assert plots_by_default(None) and not plots_by_default(False)
    assert any(isinstance(callback, MetricsPlot) for callback in Trainer(ToyModule(), toy_args(tmp_path / "b")).callbacks)
    monkeypatch.setenv("FRAMEWORK_PLOT_METRICS", "0")
    assert not plots_by_default(None)


def test_the_default_plot_is_drawn_in_another_process_and_train_does_not_wait(tmp_path, monkeypatch, framework_log):
    """Kills: drawing in ``on_end_train`` itself (this process's savefig refuses); a failure in the
    background lost (no warning) or raised into the run."""
    import matplotlib.figure

    from toy import ToyModule, toy_args

    from framework import Trainer
    from framework.callbacks import MetricsPlot

    def refuse(*args, **kwargs):
        raise AssertionError("drawn in the training process")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refuse)
    plot = MetricsPlot()
    Trainer(ToyModule(), toy_args(tmp_path, epochs=1, log_every_n_steps=2, log_level="INFO"), callbacks=[plot]).train()
    png = tmp_path / "run" / "metrics.png"
    assert plot.wait(timeout=120) == str(png)
    assert matplotlib.image.imread(str(png)).ndim == 3 and not list((tmp_path / "run").glob("*.partial"))
    assert f"metrics plot: {png}" in framework_log

    # A drawing that fails (metrics.png is a directory): a warning naming the error; train() finished.
    blocked = tmp_path / "blocked"
    plot = MetricsPlot()
    trainer = Trainer(ToyModule(), toy_args(blocked, epochs=1, log_level="INFO"), callbacks=[plot])
    (blocked / "run" / "metrics.png").mkdir(parents=True)
    trainer.train()
    assert plot.wait(timeout=120) is None
    warnings = [message for message in framework_log if "metrics.png not drawn in the background" in message]
    assert len(warnings) == 1 and "IsADirectoryError" in warnings[0], framework_log


def test_a_next_run_waits_for_the_drawing_of_the_same_png(tmp_path):
    """Kills: ``MetricsPlot.setup`` not joining an earlier run's drawing of its directory."""
    from types import SimpleNamespace

    from framework.callbacks import MetricsPlot
    from framework.metrics.background_plot import BackgroundPlot

    write_run(tmp_path)
    drawing = BackgroundPlot(str(tmp_path / "metrics.png"))
    drawing.draw(str(tmp_path / "metrics.csv"))
    MetricsPlot().setup(SimpleNamespace(is_main_process=True, args=SimpleNamespace(output_dir=str(tmp_path))))
    assert not drawing.pending and drawing.drawn  # the drawing process needs ~0.3 s for matplotlib alone
    assert matplotlib.image.imread(str(tmp_path / "metrics.png")).ndim == 3


def test_the_process_waits_for_its_drawing_before_it_exits(tmp_path):
    """Kills: no ``atexit`` join (the drawing would land after the training process has exited)."""
    program = (  # registered before the framework's own handler, so it runs after it
        "import atexit, os, sys; png = os.path.join(sys.argv[1], 'run', 'metrics.png'); "
        "atexit.register(lambda: print('png at exit:', os.path.isfile(png))); "
        "sys.path.insert(0, 'tests'); from toy import ToyModule, toy_args; from framework import Trainer; "
        "Trainer(ToyModule(), toy_args(sys.argv[1], epochs=1, plot_metrics=True)).train()"
    )
    result = subprocess.run([sys.executable, "-c", program, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "png at exit: True", result.stdout + result.stderr


def test_no_drawing_process_is_alive_while_the_run_trains(tmp_path, monkeypatch):
    """Kills: the drawing process started with training (issue 53: it imported matplotlib beside the
    training on a 2-core machine, and a program training many times had 7 of them alive at once)."""
    from toy import ToyModule, toy_args

    import framework.metrics.background_plot as background
    from framework import Trainer

    steps_at_start = []
    module = ToyModule()
    module.steps_run = 0
    real_step, real_popen = module.train_step, background.subprocess.Popen

    def counting_step(*arguments):
        module.steps_run += 1
        return real_step(*arguments)

    def recording(arguments, **kwargs):
        steps_at_start.append(module.steps_run)
        return real_popen(arguments, **kwargs)

    module.train_step = counting_step
    monkeypatch.setattr(background.subprocess, "Popen", recording)
    trainer = Trainer(module, toy_args(tmp_path, epochs=2, plot_metrics=True))
    trainer.train()
    from framework.metrics.background_plot import wait_for_plots

    assert wait_for_plots(timeout=120) == [str(tmp_path / "run" / "metrics.png")]
    assert steps_at_start == [module.steps_run] and module.steps_run > 0  # one process, after the last step
