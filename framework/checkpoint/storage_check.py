"""Refusing, before step 1, checkpoint storage that cannot serve a multi-process run.

Every rank of ``ddp`` and ``fsdp`` reads the checkpoints (and ``fsdp``'s ranks write their own
shards), so every rank must reach the same storage. fsspec's ``memory://`` filesystem lives
inside one process: rank 1 never sees what rank zero wrote (``ddp`` would fail on rank 1
only, at its first resume; ``fsdp``'s shards would be scattered over the processes). Any
other fsspec URL (``s3://``, ``gs://``, a shared mount) serves every rank.
"""

from typing import Dict, List, Optional

from framework.config.bounded_repr import bounded_repr

PER_PROCESS_PROTOCOLS = ("memory",)
"""fsspec protocols whose files exist only inside the process that wrote them."""
CACHING_PROTOCOLS = ("simplecache", "filecache", "blockcache", "cached")
"""fsspec layers that keep a local copy of each file: a sharded checkpoint, written to temporary names
and renamed into place, is renamed on the remote side while the bytes sit in the local cache."""


def protocols_of(location: str) -> List[str]:
    """The fsspec protocols of a URL, outermost first (``simplecache::s3://b`` -> ``['simplecache', 's3']``);
    [] for a plain path.

    Example:
        >>> protocols_of("simplecache::file:///tmp/x"), protocols_of("/tmp/x")
        (['simplecache', 'file'], [])
    """
    if "://" not in location and "::" not in location:
        return []
    return [part.split("://", 1)[0] for part in location.split("::") if part]


def check_storage_serves(world_size: int, backend: str, locations: Dict[str, Optional[str]], shards: bool = False) -> None:
    """Refuse storage that cannot serve the run: a protocol fsspec does not know (named with its option),
    a caching layer under a sharded backend's ``save_dir``, a per-process filesystem when ``world_size`` > 1.

    Args:
        world_size: the number of processes of the run.
        backend: the backend's name, for the message.
        locations: ``{option: path or URL}`` (``None`` values are ignored).
        shards: the backend writes sharded checkpoints (every rank its files, renamed into place).

    Raises:
        ValueError: naming the option, its value, why, and what to use instead.

    Example:
        >>> check_storage_serves(1, "sp", {"save_dir": "memory://run"})  # one process: fine
        >>> check_storage_serves(2, "ddp", {"save_dir": "memory://run"})
        Traceback (most recent call last):
        ...
        ValueError: checkpointer_args.save_dir='memory://run' cannot serve the ddp backend's 2 processes: ...
    """
    for option, location in locations.items():
        protocols = protocols_of(str(location)) if location else []
        if protocols:
            _check_known(f"checkpointer_args.{option}", str(location), protocols)
        if protocols and shards and option == "save_dir" and any(p in CACHING_PROTOCOLS for p in protocols):
            raise ValueError(
                f"checkpointer_args.{option}={bounded_repr(location)} cannot serve the {backend} backend: its ranks write "
                f"sharded checkpoints to temporary names and rename them into place, which fsspec's caching layer "
                f"({', '.join(p for p in protocols if p in CACHING_PROTOCOLS)}::) does not carry to the storage beneath "
                "(the rename finds no file). Give the storage's own URL without the cache prefix"
            )
    if world_size <= 1:
        return
    for option, location in locations.items():
        if not location:
            continue
        protocol = protocols_of(str(location))[-1] if protocols_of(str(location)) else None
        if protocol in PER_PROCESS_PROTOCOLS:  # read from the URL: a local run never imports fsspec
            raise ValueError(
                f"checkpointer_args.{option}={location!r} cannot serve the {backend} backend's {world_size} processes: "
                f"fsspec's {protocol}:// filesystem exists only inside the process that wrote it, so the other ranks "
                "would never see its checkpoints. Use a directory every rank shares (a local path on one host, a "
                "shared mount, or an object store such as s3://bucket/run)"
            )


def check_protocols(locations: Dict[str, Optional[str]], prefix: str = "checkpointer") -> None:
    """Refuse any of ``locations`` whose fsspec protocol fsspec does not know, naming its option
    (fsspec's own ``Protocol not known`` names none). Plain paths never import fsspec.

    Example:
        >>> check_protocols({"save_dir": "/tmp/run", "load_dir": None})
        >>> check_protocols({"save_dir": "MEMORY://run"})
        Traceback (most recent call last):
        ...
        ValueError: checkpointer.save_dir='MEMORY://run': fsspec knows no protocol 'MEMORY'; did you mean 'memory' ...
    """
    for option, location in locations.items():
        protocols = protocols_of(str(location)) if location else []
        if protocols:
            _check_known(f"{prefix}.{option}", str(location), protocols)
            _check_chain(f"{prefix}.{option}", str(location), protocols)


def _check_chain(option: str, location: str, protocols: List[str]) -> None:
    """Refuse a chained URL (``a::b://...``) other than caching layers over one storage: the checkpoint code
    reads and writes plain storage URLs (``dir::file://`` trained, then failed at its first save).

    Example:
        >>> _check_chain("checkpointer.save_dir", "dir::file:///tmp/x", ["dir", "file"])
        Traceback (most recent call last):
        ...
        ValueError: checkpointer.save_dir='dir::file:///tmp/x': a chained fsspec URL through dir:: is not supported; ...
    """
    if len(protocols) <= 1 or all(protocol in CACHING_PROTOCOLS for protocol in protocols[:-1]):
        return
    layers = ", ".join(f"{protocol}::" for protocol in protocols[:-1] if protocol not in CACHING_PROTOCOLS)
    raise ValueError(
        f"{option}={bounded_repr(location)}: a chained fsspec URL through {layers} is not supported; checkpoints are "
        f"read and written at a storage's own URL (a local path, file://, s3://bucket/run, ...), optionally under a "
        f"caching layer ({', '.join(p + '::' for p in CACHING_PROTOCOLS)}) for single-file checkpoints"
    )


def _check_known(option: str, location: str, protocols: List[str]) -> None:
    """Refuse a protocol fsspec has no filesystem for, naming the option (fsspec's own error names none)."""
    import fsspec  # only for URLs: a local run never imports it
    from fsspec.registry import registry

    known = set(fsspec.available_protocols()) | set(registry)  # the built-in names and those registered at run time
    for protocol in protocols:
        if protocol not in known:
            hint = f"; did you mean {protocol.lower()!r} (protocols are lower-case)" if protocol.lower() in known else ""
            raise ValueError(
                f"{option}={bounded_repr(location)}: fsspec knows no protocol {protocol!r}{hint} "
                "(a local path, file://, memory://, s3://, gs://, ... with its package installed)"
            )
