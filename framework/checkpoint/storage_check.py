"""Refusing, before step 1, checkpoint storage that cannot serve a multi-process run.

Every rank of ``ddp`` and ``fsdp`` reads the checkpoints (and ``fsdp``'s ranks write their own
shards), so every rank must reach the same storage. fsspec's ``memory://`` filesystem lives
inside one process: rank 1 never sees what rank zero wrote (``ddp`` would fail on rank 1
only, at its first resume; ``fsdp``'s shards would be scattered over the processes). Any
other fsspec URL (``s3://``, ``gs://``, a shared mount) serves every rank.
"""

from typing import Dict, Optional

PER_PROCESS_PROTOCOLS = ("memory",)
"""fsspec protocols whose files exist only inside the process that wrote them."""


def check_storage_serves(world_size: int, backend: str, locations: Dict[str, Optional[str]]) -> None:
    """Refuse a per-process filesystem for any of ``locations`` when ``world_size`` > 1.

    Args:
        world_size: the number of processes of the run.
        backend: the backend's name, for the message.
        locations: ``{option: path or URL}`` (``None`` values are ignored).

    Raises:
        ValueError: naming the option, its value, why, and what to use instead.

    Example:
        >>> check_storage_serves(1, "sp", {"save_dir": "memory://run"})  # one process: fine
        >>> check_storage_serves(2, "ddp", {"save_dir": "memory://run"})
        Traceback (most recent call last):
        ...
        ValueError: checkpointer_args.save_dir='memory://run' cannot serve the ddp backend's 2 processes: ...
    """
    if world_size <= 1:
        return
    for option, location in locations.items():
        if not location:
            continue
        protocol = str(location).split("::")[-1].split("://", 1)[0] if "://" in str(location) else None
        if protocol in PER_PROCESS_PROTOCOLS:  # read from the URL: a local run never imports fsspec
            raise ValueError(
                f"checkpointer_args.{option}={location!r} cannot serve the {backend} backend's {world_size} processes: "
                f"fsspec's {protocol}:// filesystem exists only inside the process that wrote it, so the other ranks "
                "would never see its checkpoints. Use a directory every rank shares (a local path on one host, a "
                "shared mount, or an object store such as s3://bucket/run)"
            )
