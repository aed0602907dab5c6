"""One class per way of taking an optimizer step, chosen once when the trainer prepares the step.

- :mod:`~framework.loop.steps.automatic`: micro-batches accumulated (all but a cycle's last under
  ``no_sync``), then unscale, clip, step, zero.
- :mod:`~framework.loop.steps.tbptt`: the same, each micro-batch chunk by chunk along time.
- :mod:`~framework.loop.steps.closure`: LBFGS-like optimizers re-evaluating the loss in a closure.
- :mod:`~framework.loop.steps.manual`: ``train_step`` steps the optimizers itself.

What they share (the next batch, the loss kept, the hooks, clipping, stepping the optimizers and
per-step schedulers) is :class:`~framework.loop.steps.parts.StepParts`, which each mode calls.
:class:`framework.loop.training_step.TrainingStep` picks the mode.
"""
