"""Where the whole run's fixed and per-epoch costs go: import time, set-up before step 1, epoch ends.

Relative figures (profiles are fine on a loaded machine; absolute seconds are not):

- ``imports``: ``python -X importtime -c "import framework"`` in fresh processes (median of
  ``--repeats``): the time by group (torch and what it imports, the framework's and backends'
  own modules, the third-party packages they import first: yaml, fsspec, ...), then the
  framework modules with the most self time.
- ``setup``: cProfile of ``Trainer(...)`` and ``train()`` of the tiny MLP of ``overhead.py`` for
  2 steps (after the first optimizer's ``torch._dynamo`` import, which the raw loop pays alike):
  the framework functions with the most cumulative time, and the groups (plugin entry-point scans,
  config.yaml, ...).
- ``vae``: cProfile of ``vae.py``'s port for ``--epochs`` epochs: the per-epoch cost of what
  runs at epoch ends (the default checkpoint, evaluation, logging, loader iterators).

    python benchmarks/profile_setup.py [--parts imports setup vae] [--repeats 5] [--epochs 10]
"""

import argparse
import collections
import cProfile
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OWN = ("framework", "backends")


def import_rows() -> List[Tuple[str, int, int, int]]:
    """(module, self us, cumulative us, depth) of one fresh ``import framework``."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-X", "importtime", "-c", "import framework"]
    stderr = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT).stderr
    rows = []
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if match:
            rows.append((match.group(4), int(match.group(1)), int(match.group(2)), (len(match.group(3)) - 1) // 2))
    return rows


def import_groups(rows: List[Tuple[str, int, int, int]]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Self time by group, and the self time of each framework/backends module."""
    parent: Dict[int, int] = {}
    latest: Dict[int, int] = {}
    for index in range(len(rows) - 1, -1, -1):  # a module's parent is the next line one level up
        depth = rows[index][3]
        latest[depth] = index
        if depth > 0 and depth - 1 in latest:
            parent[index] = latest[depth - 1]
    groups: Dict[str, int] = collections.defaultdict(int)
    own: Dict[str, int] = {}
    for index, (name, self_us, _, _) in enumerate(rows):
        chain, cursor = [], index
        while cursor is not None and len(chain) < 200:
            chain.append(rows[cursor][0].split(".")[0])
            cursor = parent.get(cursor)
        if "torch" in chain:
            groups["torch (with numpy and all it imports)"] += self_us
        elif chain[-1] != "framework":
            groups["interpreter start-up (site, encodings)"] += self_us
        elif chain[0] in OWN:
            groups["framework/backends modules (self)"] += self_us
            own[name] = self_us
        else:
            outermost = next(top for top in reversed(chain) if top not in OWN)
            if outermost == "numpy":  # framework.data.rng imports it just before torch, which imports it anyway
                groups["numpy (imported by the framework first; torch imports it anyway)"] += self_us
            else:
                groups[f"{outermost} (imported by the framework)"] += self_us
    return groups, own


def imports_part(repeats: int) -> None:
    runs = [import_groups(import_rows()) for _ in range(repeats)]
    print(f"## import framework: self time by group, ms (median of {repeats} fresh processes)\n")
    print("| group | ms |\n|---|---|")
    names = set().union(*(groups for groups, _ in runs))
    medians = {name: statistics.median(groups.get(name, 0) for groups, _ in runs) / 1e3 for name in names}
    for name, value in sorted(medians.items(), key=lambda item: -item[1]):
        print(f"| {name} | {value:.1f} |")
    modules = set().union(*(own for _, own in runs))
    own_medians = {name: statistics.median(own.get(name, 0) for _, own in runs) / 1e3 for name in modules}
    print(f"\n{len(modules)} framework/backends modules; the 15 with the most self time (ms):\n")
    print("| module | ms |\n|---|---|")
    for name, value in sorted(own_medians.items(), key=lambda item: -item[1])[:15]:
        print(f"| {name} | {value:.1f} |")


def function_table(stats: pstats.Stats, pattern: str, limit: int, per: int = 1) -> None:
    """The functions whose ``file:line(name)`` matches ``pattern``, by cumulative time (ms, per ``per``)."""
    rows = []
    for (filename, line, name), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        label = f"{os.path.relpath(filename, ROOT) if filename.startswith(ROOT) else os.path.basename(filename)}:{line}({name})"
        if re.search(pattern, label):
            rows.append((cumulative, calls, label))
    print("| function | calls | cumulative ms" + (" | ms per epoch |\n|---|---|---|---|" if per > 1 else " |\n|---|---|---|"))
    for cumulative, calls, label in sorted(rows, reverse=True)[:limit]:
        print(f"| `{label}` | {calls} | {1e3 * cumulative:.1f}" + (f" | {1e3 * cumulative / per:.1f} |" if per > 1 else " |"))


def setup_part() -> None:
    sys.path[:0] = [HERE, ROOT]
    import torch

    torch.set_num_threads(1)
    from torch.utils.data import TensorDataset

    from overhead import BATCH, BenchmarkModule, make_data

    from framework import Trainer, TrainerArguments

    full = make_data()
    data = TensorDataset(full.tensors[0][: 2 * BATCH], full.tensors[1][: 2 * BATCH])
    started = time.perf_counter()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    first_optimizer = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as output_dir:
        profiler = cProfile.Profile()
        profiler.enable()
        started = time.perf_counter()
        args = TrainerArguments(epochs=1, train_batch_size=BATCH, seed=0, output_dir=output_dir, use_gpu=False)
        args.checkpointer_args.period, args.checkpointer_args.save_at_end = 0, False
        trainer = Trainer(BenchmarkModule(data), args)
        constructed = time.perf_counter()
        trainer.train()
        finished = time.perf_counter()
        profiler.disable()
    print("\n## set-up of a fresh train(): the tiny MLP, 2 steps, defaults (checkpoints off); profiled\n")
    print(
        f"first optimizer of the process (torch._dynamo import; the raw loop pays it too): {first_optimizer:.3f} s; "
        f"TrainerArguments + Trainer(): {constructed - started:.3f} s; train() of 2 steps: {finished - constructed:.3f} s\n"
    )
    stats = pstats.Stats(profiler)
    function_table(stats, r"^(framework|backends)/|entry_points\)|safe_dump\)", 25)


def vae_part(epochs: int) -> None:
    sys.path[:0] = [HERE, ROOT]
    import torch

    torch.set_num_threads(1)
    import contextlib
    import io

    import vae

    import framework  # noqa: F401  (imported outside the profile)

    with tempfile.TemporaryDirectory() as output_dir, contextlib.redirect_stdout(io.StringIO()):
        vae.digits_images()  # scikit-learn's import, outside the profile
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
        profiler = cProfile.Profile()
        profiler.enable()
        vae.port(epochs, output_dir)
        profiler.disable()
    print(f"\n## the VAE port, {epochs} epochs of 12 steps and a test pass: what runs at epoch ends; profiled\n")
    stats = pstats.Stats(profiler)
    pattern = (
        r"(_train_epoch|_train_step|_end_epoch|_evaluate|save_checkpoint|default.py:\d+\(save|default.py:\d+\(serialize|"
        r"_write_atomically|_fsync_directory|_non_finite|_apply_retention|checkpoint_manager.py:\d+\(current|capture_rng_state|"
        r"_end_train_epoch|_log_epoch_summary|reduce_metrics|_record|dataloader.py:\d+\(__iter__|\(fsync)\)"
    )
    function_table(stats, pattern, 25, per=epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("imports", "setup", "vae"), default=["imports", "setup", "vae"])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes for the import figures")
    parser.add_argument("--epochs", type=int, default=10, help="VAE epochs")
    options = parser.parse_args()
    if "imports" in options.parts:
        imports_part(options.repeats)
    if "setup" in options.parts:
        setup_part()
    if "vae" in options.parts:
        vae_part(options.epochs)


if __name__ == "__main__":
    main()
