"""Weights as ``.safetensors``: one file, or Hugging Face's sharded layout with an index
(``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``).

Needs the ``[safetensors]`` extra. Paths may be local or fsspec URLs; each file is written
atomically (a reader never sees half a file).
"""

import json
import logging
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from framework.checkpoint import storage

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
ShardSize = Union[int, str, None]
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def is_safetensors(path: str) -> bool:
    """True for a ``.safetensors`` file or a ``.safetensors.index.json`` index (by the name).

    Example:
        >>> is_safetensors("model.safetensors"), is_safetensors("model.safetensors.index.json"), is_safetensors("m.pt")
        (True, True, False)
    """
    return str(path).endswith((SUFFIX, INDEX_SUFFIX))


def parse_shard_size(size: ShardSize) -> Optional[int]:
    """Bytes from an int or a string such as ``"5GB"`` (10**9) or ``"500MiB"`` (2**20); None: no limit.

    Raises:
        ValueError: not a positive size.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("1.5 MiB"), parse_shard_size(None)
        (5000000000, 1572864, None)
    """
    if size is None:
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size) if isinstance(size, str) else None
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if match and match.group(2).upper() in _UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise ValueError(f"max_shard_size={size!r} is invalid; allowed: None, a number of bytes > 0, or e.g. '5GB', '500MB', '2GiB'")


def save_safetensors(state_dict: Dict[str, torch.Tensor], path: str, max_shard_size: ShardSize = None) -> str:
    """Write ``state_dict`` to ``path`` (``*.safetensors``); above ``max_shard_size`` bytes, as
    shards ``<stem>-0000i-of-0000N.safetensors`` beside ``path`` plus ``<stem>.safetensors.index.json``
    (Hugging Face's layout). Returns the URL of the file, or of the index when sharded.

    Tensors that share memory (tied weights) are each written under their own key.

    Raises:
        ValueError: ``path`` does not end in ``.safetensors``, a bad ``max_shard_size``, or a value that is not a tensor.

    Example:
        save_safetensors(model.state_dict(), "export/model.safetensors", max_shard_size="2GB")
    """
    if not str(path).endswith(SUFFIX):
        raise ValueError(f"{path!r}: a safetensors file name ends in {SUFFIX!r}")
    limit = parse_shard_size(max_shard_size)
    tensors = _plain_tensors(state_dict)
    fs, target = storage.resolve(path)
    directory, _, name = target.rpartition("/")
    stem = name[: -len(SUFFIX)]
    shards = _split(tensors, limit)
    if len(shards) == 1:
        _write(fs, target, tensors)
        _remove_stale_index(fs, storage.join(directory, stem + INDEX_SUFFIX))
        return fs.unstrip_protocol(target)
    weight_map: Dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        shard_name = f"{stem}-{number:05d}-of-{len(shards):05d}{SUFFIX}"
        _write(fs, storage.join(directory, shard_name), shard)
        weight_map.update(dict.fromkeys(shard, shard_name))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path = storage.join(directory, stem + INDEX_SUFFIX)
    storage.write_atomically(fs, index_path, json.dumps(index, indent=2).encode(), serializer=_write_bytes)
    return fs.unstrip_protocol(index_path)


def load_safetensors(path: str) -> Tuple[str, Dict[str, torch.Tensor]]:
    """``(url, state_dict)`` from a ``.safetensors`` file or a ``.safetensors.index.json`` (every shard it names), on the CPU.

    Raises:
        FileNotFoundError: the file, or a shard the index names, is missing.

    Example:
        url, state_dict = load_safetensors("export/model.safetensors.index.json")
    """
    from safetensors.torch import load

    fs, target = storage.resolve(path)
    if not fs.isfile(target):
        raise FileNotFoundError(f"{path!r}: no such safetensors file")
    if not target.endswith(INDEX_SUFFIX):
        with fs.open(target, "rb") as handle:
            return fs.unstrip_protocol(target), load(handle.read())
    with fs.open(target, "rb") as handle:
        weight_map: Dict[str, str] = json.load(handle)["weight_map"]
    directory = target.rpartition("/")[0]
    state: Dict[str, torch.Tensor] = {}
    for shard_name in dict.fromkeys(weight_map.values()):
        shard_path = storage.join(directory, shard_name)
        if not fs.isfile(shard_path):
            raise FileNotFoundError(f"{path!r} names the shard {shard_name!r}, which is missing")
        with fs.open(shard_path, "rb") as handle:
            state.update(load(handle.read()))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{path!r}: the shards lack {missing[:5]} named in the index")
    return fs.unstrip_protocol(target), {key: state[key] for key in weight_map}


def _plain_tensors(state_dict: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    tensors, seen = {}, set()
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{key!r}] is a {type(value).__name__}; safetensors holds tensors only (save a .pt)")
        tensor = value.detach().cpu().contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()  # safetensors refuses shared memory (tied weights)
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors


def _split(tensors: Dict[str, torch.Tensor], limit: Optional[int]) -> List[Dict[str, torch.Tensor]]:
    """Consecutive keys into shards of at most ``limit`` bytes (a larger tensor alone in its shard)."""
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _write(fs: Any, path: str, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    storage.write_atomically(fs, path, save(tensors, metadata={"format": "pt"}), serializer=_write_bytes)


def _write_bytes(data: Any, handle: Any) -> None:
    handle.write(data)


def _remove_stale_index(fs: Any, index_path: str) -> None:
    """A single file replaces an earlier sharded export of the same name: its index would mislead."""
    if fs.exists(index_path):
        fs.rm(index_path)
        logger.info("removed %s from an earlier sharded export", index_path)
