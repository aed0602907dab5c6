"""What reading or writing a checkpoint file can fail with: refused, damaged, or not written."""


class CheckpointRefused(ValueError):
    """A checkpoint that ``weights_only`` loading refuses to unpickle (pickled objects, blocked
    modules such as ``posix.system``, bytes before the zip archive, a sharded index that cannot
    be proven to be the one written with it). It stops the run with the file named; it is never
    treated as damaged and never skipped for an older checkpoint.

    Example:
        >>> raise CheckpointRefused("runs/x/checkpoint-000000003.pt holds pickled Python objects ...")
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CheckpointRefused: runs/x/checkpoint-000000003.pt holds pickled Python objects ...
    """


class CorruptCheckpoint(ValueError):
    """A checkpoint is truncated or damaged (the reason names what failed): resuming skips it for
    the previous one, with a warning."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed with an OS error (ENOSPC, EIO, ...); the message names the file.

    ``errno`` is the OS error's; the previous checkpoint is untouched.

    Example:
        >>> str(CheckpointWriteError(28, "could not write checkpoint runs/x/checkpoint-000000008.pt: No space left on device"))
        '[Errno 28] could not write checkpoint runs/x/checkpoint-000000008.pt: No space left on device'
    """
