"""Train the digits classifier: ``python examples/run.py [--config FILE] [--section.field VALUE]``.

Without ``--config`` it reads ``examples/digits.yaml``. Run it again and the new run trains in
``outputs/digits/version_1`` (then ``version_2``, ...); ``--checkpointer.resume auto`` continues the
run in ``outputs/digits`` instead.

Under torchrun: ``torchrun --nproc_per_node=2 examples/run.py --backend ddp``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from digits import DigitsArguments, DigitsClassifier

from framework import Trainer, parse_config, seed_everything
from framework.checkpoint import RunDirectoryInUse
from framework.run.run_lock import RunLocked

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.yaml")


def main(argv=None) -> float:
    on_command_line = argv is None  # there, a config error prints "error: ..." and exits 2 (no traceback)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        argv = ["--config", DEFAULT_CONFIG, *argv]
    config = parse_config({"model": DigitsArguments}, argv=argv, program="examples/run.py", exit_on_error=on_command_line)
    seed_everything(config.trainer.seed)  # before the model is built, so its initial weights repeat
    module = config.build_module(default=lambda: DigitsClassifier(config.model))  # or from model: class_path
    trainer = Trainer(module=module, args=config.trainer)
    history = trainer.train()
    accuracy = history.latest("val_accuracy")
    if accuracy is None:  # stopped before any validation (e.g. --trainer.max_steps 3): measure the final weights
        accuracy = trainer.validate()["val_accuracy"]
    if trainer.is_main_process:
        print(f"final val_accuracy={accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    try:
        main()
    except (RunDirectoryInUse, RunLocked) as error:  # another run's directory: one line that says the ways on, exit 1
        sys.exit(f"examples/run.py: error: {error}")
