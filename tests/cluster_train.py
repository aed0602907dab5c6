"""Train the toy module under any launcher: ``<launcher> python tests/cluster_train.py OUT BACKEND``.

Rank zero saves the final parameters to ``OUT/weights.pt``; every rank prints one line
with its cluster environment, rank and world size.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from toy import ToyModule, flat_parameters  # noqa: E402

from framework import Trainer, TrainerArguments  # noqa: E402

out, backend = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
module = ToyModule(n_train=128, n_val=32)
args = TrainerArguments(
    epochs=2, train_batch_size=32, backend=backend, disable_tqdm=True, output_dir=out, log_every_n_steps=2
)
trainer = Trainer(module, args)
trainer.train()
environment = trainer.backend.cluster_environment
print(f"cluster={environment.name} rank={trainer.backend.rank} world={trainer.backend.world_size}", flush=True)
if trainer.is_main_process:
    torch.save(flat_parameters(module), os.path.join(out, "weights.pt"))
