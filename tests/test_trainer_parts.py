"""The trainer's parts (framework/loop/trainer_parts.py): each takes what it needs by keyword, none is
given the trainer, the trainer holds every part under the part's name, and trainer.py stays the loop
(at most 400 lines)."""

import dataclasses
import inspect
import os

from toy import ToyModule, toy_args

from framework import Trainer
from framework.loop.trainer_parts import TrainerParts, build_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a constructor that requires three collaborators or more takes them by keyword only (HookDispatcher,
# LossTracker, StepRunner, PreemptionHandler take one or two and stay positional)
MANY_COLLABORATORS = 3


def part_classes():
    hints = {field.name: field.type for field in dataclasses.fields(TrainerParts)}
    return {name: kind for name, kind in hints.items() if inspect.isclass(kind)}


def test_every_part_with_several_collaborators_takes_them_by_keyword_only():
    positional = {}
    for name, kind in part_classes().items():
        parameters = list(inspect.signature(kind.__init__).parameters.values())[1:]  # self
        if sum(p.default is inspect.Parameter.empty for p in parameters) >= MANY_COLLABORATORS:
            loose = [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
            if loose:
                positional[name] = loose
    assert positional == {}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in inspect.signature(build_parts).parameters.values())


def test_no_part_is_given_the_trainer():
    """A part given the whole trainer could reach any other part; each is given only its collaborators."""
    given = {}
    for name, kind in part_classes().items():
        for parameter in list(inspect.signature(kind.__init__).parameters.values())[1:]:
            annotation = str(parameter.annotation)
            if parameter.name in ("trainer", "view") or "TrainerView" in annotation or "Trainer'" in annotation:
                given.setdefault(name, []).append(parameter.name)
    assert given == {}


def test_the_trainer_holds_every_part_under_its_name(tmp_path):
    trainer = Trainer(ToyModule(), toy_args(tmp_path, epochs=1))
    try:
        names = [field.name for field in dataclasses.fields(TrainerParts)]
        missing = [name for name in names if name not in vars(trainer)]
        assert missing == []
        # one object per part, shared: what the run start restores is what the loop counts
        assert trainer.run_start.progress is trainer.progress is trainer.checkpoint_manager.progress
        assert trainer.evaluation.recorder is trainer.recorder
    finally:
        trainer.close()
    trainer = Trainer(ToyModule(), toy_args(tmp_path / "again", epochs=1))
    trainer.train()
    assert trainer.global_steps_finished == trainer.progress.global_steps_finished > 0


def test_trainer_py_is_the_loop_in_at_most_400_lines():
    with open(os.path.join(ROOT, "framework", "loop", "trainer.py")) as handle:
        source = handle.read()
    assert source.count("\n") <= 400
    assert "fmt: skip" not in source  # no positional wiring held in shape by hand
    for story in ("def train(self)", "def _train_epoch(self)", "def _start_epoch(self)", "def _end_epoch(self)"):
        assert story in source  # the loop reads top to bottom here, not elsewhere
