"""Lightning's names for settings that live under other names here: aliases read with a hint, and
names refused with where their setting is (see docs/from-lightning.md)."""

LIGHTNING_TOP_LEVEL = {
    "seed_everything": "trainer.seed",
    "ckpt_path": "checkpointer.load_dir (a checkpoint to start from) or checkpointer.resume",
}
"""LightningCLI's top-level keys, refused with where their setting lives here."""
LIGHTNING_ALIASES = {
    "trainer.max_epochs": "trainer.epochs",
    "trainer.default_root_dir": "trainer.output_dir",
    "trainer.limit_train_batches": "trainer.max_train_steps_per_epoch",
    "trainer.limit_val_batches": "trainer.max_val_steps_per_epoch",
    "trainer.check_val_every_n_epoch": "trainer.val_every_n_epochs",
    "trainer.val_check_interval": "trainer.val_every_n_steps",
    "trainer.num_sanity_val_steps": "trainer.sanity_val_steps",
}
"""Lightning's ``Trainer`` argument names accepted for the same setting here (with a hint naming it)."""
LIGHTNING_HINTS = {
    "trainer.gradient_clip_val": "trainer.clip_grads: true with trainer.max_grad_norm (or trainer.clip_grad_value)",
    "trainer.strategy": "trainer.backend (sp, ddp, fsdp, model-parallel, ...; see --help)",
    "trainer.precision": "part of the backend's name: --backend sp-amp, ddp-amp, sp-bf16, ...",
    "trainer.accelerator": "trainer.use_gpu (the processes come from the launcher, e.g. torchrun)",
    "trainer.devices": "the launcher's process count (torchrun --nproc_per_node N)",
    "trainer.accumulate_grad_batches": (
        "derived: trainer.train_batch_size is the global batch, trainer.gpu_batch_size_limit the micro-batch"
    ),
    "trainer.enable_progress_bar": "trainer.disable_tqdm (the opposite)",
    "trainer.callbacks": "a list of {class_path, init_args} (given here as something else)",
}
"""Lightning's names that have no one-to-one field here: refused with where the setting lives."""
