"""One sentence saying when checkpoints are written, where, and how many are kept."""

from framework.checkpoint.arguments import DefaultCheckpointerArguments


def describe_checkpointing(args: DefaultCheckpointerArguments, save_dir: str) -> str:
    """What :class:`DefaultCheckpointer` will write and keep, as logged when training starts.

    Example:
        >>> describe_checkpointing(DefaultCheckpointerArguments(), "outputs/checkpoints")
        'checkpoints: every epoch and at the end into outputs/checkpoints, keeping the newest 3 (checkpointer.keep_last_n)'
        >>> describe_checkpointing(DefaultCheckpointerArguments(period=2, save_every_n_steps=500, keep_last_n=None), "ckpt")
        'checkpoints: every 2 epochs, every 500 steps and at the end into ckpt, keeping all'
        >>> describe_checkpointing(DefaultCheckpointerArguments(keep_best_n=1), "ckpt")
        'checkpoints: every epoch and at the end into ckpt, keeping the newest 3 (+1 best by val_loss) (checkpointer.keep_last_n)'
        >>> describe_checkpointing(DefaultCheckpointerArguments(period=0, save_at_end=False), "ckpt")
        'checkpoints: none written (checkpointer.period=0, save_every_n_steps=None, save_at_end=False)'
    """
    when = []
    if args.period:
        when.append("every epoch" if args.period == 1 else f"every {args.period} epochs")
    if args.save_every_n_steps:
        when.append(f"every {args.save_every_n_steps} steps")
    if args.save_at_end:
        when.append("at the end")
    if not when:
        return "checkpoints: none written (checkpointer.period=0, save_every_n_steps=None, save_at_end=False)"
    schedule = when[0] if len(when) == 1 else ", ".join(when[:-1]) + " and " + when[-1]
    if args.keep_last_n is None:
        kept = "keeping all"
    elif args.keep_last_n == 0:
        kept = f"keeping the best {args.keep_best_n} by {args.metric} ({args.mode}) only (checkpointer.keep_last_n=0)"
    else:
        best = f" (+{args.keep_best_n} best by {args.metric})" if args.keep_best_n else ""
        kept = f"keeping the newest {args.keep_last_n}{best} (checkpointer.keep_last_n)"
    return f"checkpoints: {schedule} into {save_dir}, {kept}"
