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

LIGHTNING_CALLBACK_MODULES = ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")
"""Where Lightning's callbacks live; a ``class_path`` there names ``framework.callbacks``' class of the same name."""
MODEL_CHECKPOINT = (
    "Lightning's ModelCheckpoint is the checkpointer: section here, not a callback: "
    "checkpointer.metric (monitor), checkpointer.mode (mode), checkpointer.keep_best_n (save_top_k), "
    "checkpointer.keep_last_n (0: only the best), checkpointer.period (every_n_epochs), "
    "checkpointer.save_every_n_steps (every_n_train_steps), checkpointer.save_dir (dirpath), "
    "checkpointer.save_at_end (save_last); e.g. checkpointer: {metric: val_acc, mode: max, keep_best_n: 2, keep_last_n: 0}"
)
"""The refusal of a ``ModelCheckpoint`` in ``trainer.callbacks``: where each of its arguments lives."""


def lightning_callback_hint(class_path: str) -> str:
    """The message for a ``trainer.callbacks`` entry naming one of Lightning's callbacks ("" for others):
    ``ModelCheckpoint`` points to the ``checkpointer:`` section, the others to ``framework.callbacks``.

    Example:
        >>> lightning_callback_hint("lightning.pytorch.callbacks.EarlyStopping")
        "Lightning's class: use class_path: framework.callbacks.EarlyStopping (the same arguments)"
        >>> lightning_callback_hint("lightning.pytorch.callbacks.ModelCheckpoint")[:51]
        "Lightning's ModelCheckpoint is the checkpointer: se"
    """
    module, _, name = class_path.rpartition(".")
    if name == "ModelCheckpoint":
        return MODEL_CHECKPOINT
    if module.startswith(LIGHTNING_CALLBACK_MODULES):
        import framework.callbacks as ours

        if hasattr(ours, name):
            return f"Lightning's class: use class_path: framework.callbacks.{name} (the same arguments)"
    return ""
