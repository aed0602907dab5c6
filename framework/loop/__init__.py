"""The training loop: the trainer, its hooks, steps, optimizers and schedulers, and its checkpoints."""
