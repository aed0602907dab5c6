"""The trainer's evaluation component (``trainer.evaluation``): what it remembers between calls."""

from logs import captured_log

from toy import ToyModule, toy_args

from framework import Trainer
from framework.checkpoint import DefaultCheckpointerArguments


def test_weights_a_call_loaded_are_known_to_later_calls(tmp_path):
    # Mutant: TrainerEvaluation.load_checkpoint_weights forgets (weights_loaded stays False).
    checkpoints = DefaultCheckpointerArguments(period=1, resume="auto")
    Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints)).train()
    trainer = Trainer(ToyModule(scheduler=None), toy_args(tmp_path, train_batch_size=32, checkpoints=checkpoints))
    with captured_log("framework") as messages:
        trainer.validate()  # untrained weights while a checkpoint waits: a warning
        assert sum("neither trained nor loaded" in m for m in messages) == 1
        loaded = trainer.validate(checkpoint="last")
        again = trainer.validate()  # the loaded weights: no second warning
    assert sum("neither trained nor loaded" in m for m in messages) == 1
    assert again == loaded
