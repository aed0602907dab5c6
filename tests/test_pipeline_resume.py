"""Every train data pipeline (``tests/pipelines.py``) resumes bitwise after a real mid-epoch SIGKILL,
or is told before step 1 that it cannot continue inside an epoch and resumes from the epoch end.

Each run is ``tests/resume_script.py --pipeline NAME`` in a fresh process (2 epochs of 8 steps,
micro-batches of 4 accumulated in pairs, a checkpoint every 3 steps), killed once (twice for
``stateful-sampler``: also right after the first epoch-end checkpoint) and run again; the
uninterrupted reference runs in this process. The killed runs of all pipelines run side by side,
then their resumes (``test_resume.py`` kills the script's default pipeline, ``sampler``, at more points).
"""

import os
import signal
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest
import torch
import torchdata.stateful_dataloader  # noqa: F401 - the dev extra; the pipelines need it

import resume_script

HERE = os.path.dirname(os.path.abspath(__file__))
ARGUMENTS = ["--epochs", "2", "--n-train", "64", "--batch", "8", "--micro", "4", "--save-every", "3"]
MID_EPOCH = ("mb:1:9", 12)  # killed after micro-batch 9 of epoch 1 (step 13 not taken): resumes at step 12
EPOCH_END = ("begin:1", 8)  # killed right after the first epoch-end checkpoint
CASES: Dict[str, Tuple[List[Tuple[str, int]], str]] = {  # pipeline: (kill points and resume steps, what it proves)
    "sampler": ([MID_EPOCH], "the framework's sampler in a plain DataLoader"),
    "stateful-sampler": ([EPOCH_END, MID_EPOCH], "torchdata's StatefulDataLoader with the framework's sampler"),
    "stateful-shuffle": ([MID_EPOCH], "StatefulDataLoader(shuffle=True)"),
    "workers": ([MID_EPOCH], "2 workers, torch.randn augmentation in __getitem__"),
    "stateful-workers": ([MID_EPOCH], "the same in a StatefulDataLoader"),
    "stream": ([MID_EPOCH], "an IterableDataset with state_dict()"),
    "stream-stateless": ([(MID_EPOCH[0], 8)], "an IterableDataset without state: resumes from the epoch end"),
}
CANNOT = "so a run cannot continue inside an epoch; checkpoints are saved only at epoch ends"

pytestmark = pytest.mark.slow


def start(out: str, pipeline: str, kills: List[Tuple[str, int]]) -> subprocess.Popen:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    command = [sys.executable, os.path.join(HERE, "resume_script.py"), out, "--pipeline", pipeline, *ARGUMENTS]
    command += [argument for point, _ in kills for argument in ("--kill", point)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_all(processes: Dict[str, subprocess.Popen]) -> Dict[str, Tuple[int, str]]:
    return {name: (process.wait(timeout=300), process.communicate()[0]) for name, process in processes.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per pipeline: the reference's result, and each process's (return code, output) in order."""
    root = tmp_path_factory.mktemp("pipelines")
    outputs: Dict[str, List[Tuple[int, str]]] = {name: [] for name in CASES}
    kills_left = {name: len(kills) for name, (kills, _) in CASES.items()}
    waves = 0
    while any(left >= 0 for left in kills_left.values()):  # each wave: one process per unfinished pipeline
        processes = {name: start(str(root / name), name, CASES[name][0]) for name in CASES if kills_left[name] >= 0}
        if waves == 0:  # the references, while the first wave runs
            references = {}
            for name in CASES:
                resume_script.main([str(root / f"{name}-reference"), "--pipeline", name, *ARGUMENTS])
                references[name] = torch.load(root / f"{name}-reference" / "result.pt", weights_only=True)
        for name, finished in wait_all(processes).items():
            outputs[name].append(finished)
            kills_left[name] -= 1
        waves += 1
    return {name: (references[name], outputs[name], torch.load(root / name / "result.pt", weights_only=True)) for name in CASES}


@pytest.mark.parametrize("pipeline", list(CASES))
def test_a_pipeline_resumes_bitwise_after_sigkill_or_is_told_at_start(runs, pipeline):
    reference, processes, resumed = runs[pipeline]
    kills, _ = CASES[pipeline]
    assert [code for code, _ in processes] == [-signal.SIGKILL] * len(kills) + [0], processes[-1][1][-3000:]
    for (point, resume_step), (_, output) in zip(kills, processes[1:]):
        assert f"step {resume_step})" in output.split("loaded checkpoint", 1)[1].splitlines()[0], (point, output[-3000:])
    first_output = processes[0][1]
    if pipeline == "stream-stateless":
        assert first_output.index(CANNOT) < first_output.index("STARTED at step 0")  # told before step 1
    else:
        assert CANNOT not in first_output
    assert torch.equal(resumed["params"], reference["params"]), (resumed["params"] - reference["params"]).abs().max().item()
    assert resumed["history"] == reference["history"]
