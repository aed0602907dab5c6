"""Draw a run's training and validation curves from ``metrics.csv`` to a PNG.

Usage: ``python -m framework.metrics.plot OUTPUT_DIR [-o metrics.png] [--metrics loss,accuracy]``
(needs the ``[plot]`` extra: matplotlib).
"""

import argparse
import csv
import math
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

_STAGES = ("train_", "val_", "test_")
_REQUIRED_COLUMNS = ("step", "name", "value")

Series = Dict[str, List[Tuple[int, float]]]


def read_metrics(path: str) -> Series:
    """``{name: [(step, value), ...]}`` from a ``metrics.csv`` (columns epoch, step, name, value).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a column is missing or a row does not parse (with its line number).

    Example:
        read_metrics("outputs/metrics.csv")["val_loss"]
        [(10, 0.52), (20, 0.31)]
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path!r}; train with output_dir set, or pass the file itself")
    from backends.checkpoint_io import run_files  # the one door for files (not in the drawing process)

    return parse_metrics(run_files.read_text(path, run_files.METRICS).splitlines(), path)


def parse_metrics(lines: Iterable[str], path: str) -> Series:
    """:func:`read_metrics` of ``metrics.csv``'s lines already read (``path`` names them in errors).

    Example:
        >>> dict(parse_metrics(["epoch,step,name,value", "0,2,train_loss,0.5"], "metrics.csv"))
        {'train_loss': [(2, 0.5)]}
    """
    series: Series = OrderedDict()
    reader = csv.DictReader(lines)
    missing = [column for column in _REQUIRED_COLUMNS if column not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path!r} lacks the columns {missing}; expected epoch,step,name,value (got {reader.fieldnames})")
    for line, row in enumerate(reader, start=2):
        try:
            step, value = int(row["step"]), float(row["value"])
        except (TypeError, ValueError):
            raise ValueError(f"{path!r} line {line}: cannot read step={row['step']!r} value={row['value']!r}") from None
        series.setdefault(row["name"], []).append((step, value))
    return series


def panel_of(name: str) -> str:
    """The panel a metric is drawn in: stage prefix, ``_epoch`` suffix and ``/loader`` removed.

    Example:
        >>> [panel_of(n) for n in ("train_loss", "train_loss_epoch", "val_loss/set1", "val_accuracy", "lr")]
        ['loss', 'loss', 'loss', 'accuracy', 'lr']
    """
    base = name.split("/", 1)[0]
    for prefix in _STAGES:
        if base.startswith(prefix):
            base = base[len(prefix) :]
            break
    if base.endswith("_epoch"):
        base = base[: -len("_epoch")]
    return base or name


def _panel_rank(panel: str, names: List[str]) -> int:
    """Loss first, then other train/validation quantities, then the rest, times last."""
    if panel == "loss":
        return 0
    if panel.endswith("time"):
        return 3
    return 1 if any(name.startswith(_STAGES) for name in names) else 2


def plot_metrics(
    source: str,
    output: Optional[str] = None,
    panels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> str:
    """Draw every metric of ``source`` (an output directory or a metrics.csv) against the
    optimizer step, one panel per quantity: train, epoch-mean train and validation curves of
    the same quantity share a panel; the loss panel has a log axis (when every loss is > 0).
    Returns the PNG's path.

    Args:
        source: the run's ``output_dir`` or its ``metrics.csv``.
        output: PNG path (default: ``metrics.png`` next to the CSV).
        panels: only these panels (e.g. ``["loss", "accuracy"]``), in this order.
        title: figure title (default: the run directory).

    Raises:
        ImportError: matplotlib is missing (install the ``[plot]`` extra).
        ValueError: no metrics to draw, or an unknown panel name (the known ones are listed).

    Example:
        plot_metrics("outputs/digits")
        'outputs/digits/metrics.png'
    """
    csv_path = source if os.path.isfile(source) or source.endswith(".csv") else os.path.join(source, "metrics.csv")
    return plot_series(read_metrics(csv_path), csv_path, output, panels, title)


def plot_series(
    series: Series,
    csv_path: str,
    output: Optional[str] = None,
    panels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> str:
    """:func:`plot_metrics` of series already read from ``csv_path`` (which names the defaults:
    the PNG beside it, the title its directory). The PNG is written under a temporary name and
    renamed into place, so a reader never sees half an image."""
    try:  # a Figure of its own, not pyplot: the user's backend and figures are left alone
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install 'torch-trainer-framework[plot]'") from error
    if not series:
        raise ValueError(f"{csv_path!r} holds no metric values yet")
    grouped: Dict[str, List[str]] = OrderedDict()
    for name in series:
        grouped.setdefault(panel_of(name), []).append(name)
    grouped = OrderedDict(sorted(grouped.items(), key=lambda item: _panel_rank(*item)))
    if panels:
        unknown = [panel for panel in panels if panel not in grouped]
        if unknown:
            raise ValueError(f"unknown panels {unknown}; this run has {list(grouped)}")
        grouped = OrderedDict((panel, grouped[panel]) for panel in panels)
    columns = min(3, len(grouped))
    rows = math.ceil(len(grouped) / columns)
    figure = Figure(figsize=(5.2 * columns, 3.6 * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis, (panel, names) in zip(axes.flat, grouped.items()):
        for name in names:
            points = series[name]
            steps, values = [p[0] for p in points], [p[1] for p in points]
            style = {"marker": "o", "markersize": 3} if len(points) <= 30 else {}
            if name.split("/", 1)[0].endswith("_epoch"):
                style.update(linestyle="--")
            axis.plot(steps, values, label=name, linewidth=1.4, **style)
        if panel == "loss" and all(value > 0 for name in names for _, value in series[name]):
            axis.set_yscale("log")  # a loss falls by orders of magnitude: a log axis shows all of it
        axis.set_title(panel)
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if len(names) > 1 or names[0] != panel:
            axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(grouped) :]:
        axis.set_visible(False)
    figure.suptitle(title or os.path.basename(os.path.dirname(os.path.abspath(csv_path))))
    figure.tight_layout()
    output = output or os.path.join(os.path.dirname(os.path.abspath(csv_path)), "metrics.png")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    extension = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    partial = f"{output}.{os.getpid()}.partial"
    try:
        figure.savefig(partial, dpi=110, format=extension)
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return output


def main(argv: Optional[Sequence[str]] = None) -> str:
    """The ``python -m framework.metrics.plot`` command line."""
    parser = argparse.ArgumentParser(prog="python -m framework.metrics.plot", description="Draw metrics.csv curves to a PNG.")
    parser.add_argument("source", help="the run's output_dir, or a metrics.csv file")
    parser.add_argument("-o", "--output", help="PNG path (default: metrics.png next to metrics.csv)")
    parser.add_argument("--metrics", help="comma-separated panels to draw, e.g. loss,accuracy (default: all)")
    parser.add_argument("--title", help="figure title")
    options = parser.parse_args(argv)
    panels = [part.strip() for part in options.metrics.split(",") if part.strip()] if options.metrics else None
    try:
        path = plot_metrics(options.source, options.output, panels, options.title)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(2, f"python -m framework.metrics.plot: error: {error}\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
