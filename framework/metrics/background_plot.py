"""Draw ``metrics.png`` in a process of its own, off ``train()``'s critical path.

The drawing process starts when training has ended, never during it (it imports matplotlib,
about 0.3 s of the 0.5 s a plot costs: on a small machine it would compete with training), at the
program's priority (a program that ends waits for it at exit: at ``nice`` +10 on a busy machine
that wait grew to 8-24 s, issue 53); a next ``train()`` in the same program lowers it to ``nice``
+10 before its first step (:func:`lower_pending_priority`: that run keeps the CPU first). The
trainer hands it ``metrics.csv``'s text (so a next run may rewrite the file at once) and returns.
A thread waits for the process and logs the outcome: ``metrics plot: PATH``, or a warning naming
the error (never an exception in the run). Pending drawings are joined before the interpreter
exits (``atexit``) and before a next run's plot callback starts on the same PNG
(:func:`wait_for_plots`). The process takes nothing from the working directory: its path loses
the entry ``-c`` puts first before its first import.
"""

import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional

logger = logging.getLogger("framework.callbacks.metrics_plot")

PLOT_MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot.py")

# The drawing process: removes the working directory from its path, loads
# plot.py by path (no ``import framework``: torch stays out of it), then reads one job: a length
# line, then that many bytes of JSON. A length read from the pipe, not its end: a DataLoader worker
# forked meanwhile keeps the pipe open.
WORKER = r"""
import sys
if sys.path and sys.path[0] in ("", "."):  # ``-c`` put the working directory first: nothing is imported from it
    del sys.path[0]
import importlib.util, json, os
spec = importlib.util.spec_from_file_location("_framework_metrics_plot", sys.argv[1])
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)
header = sys.stdin.buffer.readline().strip()
if not header:
    sys.exit(0)
job = json.loads(sys.stdin.buffer.read(int(header)))
try:
    series = plot.parse_metrics(job["csv"].splitlines(), job["csv_path"])
    plot.plot_series(series, job["csv_path"], job["output"])
except Exception as error:
    sys.stderr.write(f"{type(error).__name__}: {error}")
    sys.exit(1)
"""

_pending: Dict[int, "BackgroundPlot"] = {}
_pending_lock = threading.Lock()


class BackgroundPlot:
    """One ``metrics.png``, drawn by a process of its own that :meth:`draw` starts.

    Args:
        output: the PNG the drawing writes.
        timeout: seconds the drawing may take after :meth:`draw`; then it is killed and a warning logged.

    Example:
        drawing = BackgroundPlot("outputs/metrics.png")   # at training's start: nothing runs yet
        ...                                               # training
        drawing.draw("outputs/metrics.csv")               # returns at once; the drawing process starts
        drawing.wait()                                    # 'outputs/metrics.png', or None (a warning says why)
    """

    def __init__(self, output: str, timeout: float = 120.0) -> None:
        self.output = output
        self.timeout = timeout
        self.drawn: Optional[bool] = None
        """True once the PNG is in place, False when the drawing failed or was cancelled, None while pending."""
        self.error: Optional[str] = None
        """Why the drawing failed (None: it did not)."""
        self._thread: Optional[threading.Thread] = None
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._lowered = False

    def lower_priority(self) -> None:
        """Run the drawing at ``nice`` +10 from now on (a next run trains): at once where its process
        is alive, as soon as it starts where it has not yet."""
        self._lowered = True
        process = self._process
        if process is not None and process.poll() is None:
            _lower(process.pid)

    def draw(self, csv_path: str) -> None:
        """Draw ``csv_path``'s metrics (read here, so the file is free at once) in the background."""
        from backends.checkpoint_io import run_files  # the one door for files

        if self.drawn is not None or self._thread is not None:
            raise RuntimeError(f"the drawing of {self.output!r} was already given its metrics")
        try:
            text = run_files.read_text(csv_path, run_files.METRICS)
        except (OSError, run_files.UnsafeRunFile) as error:
            self._fail(f"{type(error).__name__}: {error}")
            return
        job = {"csv": text, "csv_path": os.path.abspath(csv_path), "output": self.output}
        self._thread = threading.Thread(target=self._run, args=(job,), name="metrics-plot", daemon=True)
        with _pending_lock:
            _pending[id(self)] = self
        self._thread.start()  # the process is spawned there: a fork-exec of a large process costs ~20 ms

    def cancel(self) -> None:
        """No plot after all (the run failed, or wrote no metrics)."""
        if self.drawn is None and self._thread is None:
            self.drawn = False

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Wait for the drawing (cancelled first if it was never given metrics); the PNG's path,
        or None where it failed (a warning was logged) or did not finish within ``timeout``."""
        self.cancel()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.output if self.drawn else None

    @property
    def pending(self) -> bool:
        """Whether the drawing is still under way."""
        return self._thread is not None and self._thread.is_alive()

    def _fail(self, error: str) -> None:
        self.drawn, self.error = False, error
        logger.warning("metrics.png not drawn in the background (%s); training itself finished", error)

    def _run(self, job: Dict[str, Any]) -> None:
        try:
            self._draw_in_process(job)
        except Exception as error:  # never lost, never raised into the run
            self._fail(f"{type(error).__name__}: {error}")
        finally:
            with _pending_lock:
                _pending.pop(id(self), None)

    def _draw_in_process(self, job: Dict[str, Any]) -> None:
        process = subprocess.Popen(
            [sys.executable, "-c", WORKER, PLOT_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._process = process
        if self._lowered:
            _lower(process.pid)
        payload = json.dumps(job).encode()
        try:
            _, errors = process.communicate(b"%d\n" % len(payload) + payload, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            self._fail(f"no PNG after {self.timeout:g} s; the drawing process was stopped")
            return
        if process.returncode != 0:
            text = errors.decode(errors="replace").strip().splitlines()
            self._fail(text[-1] if text else f"the drawing process exited with status {process.returncode}")
            return
        self.drawn = True
        logger.info("metrics plot: %s", self.output)


def wait_for_plots(output: Optional[str] = None, timeout: Optional[float] = None) -> List[str]:
    """Wait for the background drawings (only those of the PNG ``output`` when given); the PNGs
    drawn. A drawing never given its metrics is cancelled. Called at exit and before a run draws
    where an earlier one still does; call it yourself before removing a run's directory.

    Example:
        >>> wait_for_plots()
        []
    """
    with _pending_lock:
        drawings = list(_pending.values())
    if output is not None:
        drawings = [drawing for drawing in drawings if os.path.abspath(drawing.output) == os.path.abspath(output)]
    drawn = [drawing.wait(timeout) for drawing in drawings]
    return [path for path in drawn if path is not None]


def lower_pending_priority() -> None:
    """Lower every pending drawing of this process to ``nice`` +10: a run about to train keeps the
    CPU first (called by ``train()`` before its first step).

    Example:
        >>> lower_pending_priority()  # no drawing pending: nothing to do
    """
    with _pending_lock:
        drawings = list(_pending.values())
    for drawing in drawings:
        drawing.lower_priority()


def _lower(pid: int) -> None:
    """``nice`` +10 for process ``pid`` (never raised back: a lower niceness needs privileges)."""
    with contextlib.suppress(OSError, AttributeError):  # gone already, or not POSIX
        os.setpriority(os.PRIO_PROCESS, pid, max(10, os.getpriority(os.PRIO_PROCESS, pid)))


atexit.register(wait_for_plots)
