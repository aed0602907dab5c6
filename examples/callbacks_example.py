"""Digits with callbacks, mid-epoch validation and the CLI.

    python examples/callbacks_example.py
    python examples/callbacks_example.py --trainer.val_every_n_steps 5 --early_stopping.patience 2
    python examples/callbacks_example.py --help

Validation runs every ``trainer.val_every_n_steps`` optimizer steps; ``EarlyStopping`` watches
``val_loss`` after each one; ``LearningRateMonitor`` records the one-cycle schedule; ``Timer``
and ``ModelSummary`` report time and size. The run's config, ``metrics.csv`` and (with
matplotlib) ``metrics.png`` land in ``trainer.output_dir``.
"""

import os
import sys
from dataclasses import dataclass
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from digits import DigitsArguments, DigitsClassifier

from framework import Trainer, parse_config, seed_everything
from framework.callbacks import EarlyStopping, LearningRateMonitor, ModelSummary, Timer

# Defaults for this example; anything on the command line comes later and wins.
DEFAULTS = [
    "--trainer.epochs=20",
    "--trainer.train_batch_size=64",
    "--trainer.val_every_n_steps=10",
    "--trainer.val_every_n_epochs=0",
    "--trainer.log_every_n_steps=5",
    "--trainer.seed=0",
    "--trainer.output_dir=outputs/callbacks_example",
    "--checkpointer.period=0",
    "--checkpointer.save_at_end=false",
]


@dataclass
class EarlyStoppingArguments:
    """When to stop: the early_stopping section of the example's config."""

    monitor: str = "val_loss"
    """Metric to watch."""
    mode: str = "min"
    """min or max: which direction is better."""
    patience: int = 4
    """Validations without improvement before stopping."""
    min_delta: float = 0.002
    """Smallest change that counts as an improvement."""


def main(argv: Optional[List[str]] = None) -> Trainer:
    argv = DEFAULTS + list(sys.argv[1:] if argv is None else argv)
    config = parse_config(
        {"model": DigitsArguments, "early_stopping": EarlyStoppingArguments},
        argv=argv,
        program="examples/callbacks_example.py",
    )
    seed_everything(config.trainer.seed)  # before the model is built: its initial weights are reproducible
    stopper = EarlyStopping(**vars(config.early_stopping))
    callbacks = [ModelSummary(), LearningRateMonitor(), Timer(), stopper]
    trainer = Trainer(module=DigitsClassifier(config.model), args=config.trainer, callbacks=callbacks)
    history = trainer.train()
    if trainer.is_main_process:
        stopped = f"stopped early at step {stopper.stopped_step} ({stopper.reason})" if stopper.stopped_step else "ran all epochs"
        print(
            f"{stopped}; best {stopper.monitor}={stopper.best:.4f} at step {stopper.best_step}; "
            f"val_accuracy={history.latest('val_accuracy'):.4f}; {trainer.global_steps_finished} steps"
        )
        try:
            from framework import plot_metrics

            print("curves:", plot_metrics(config.trainer.output_dir))
        except ImportError:
            print("pip install 'torch-trainer-framework[plot]' to draw the curves")
    return trainer


if __name__ == "__main__":
    main()
