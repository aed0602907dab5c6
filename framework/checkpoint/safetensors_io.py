"""Weights as ``.safetensors``: one file, or Hugging Face's sharded layout with an index
(``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json``).

Needs the ``[safetensors]`` extra. Paths may be local or fsspec URLs.

An export appears whole or not at all: each file is written atomically; a sharded export
writes its shards under hidden ``.<shard>.partial`` names first (the previous export stays
whole meanwhile), then removes the previous index, moves the shards into place and writes
its index last. A process killed at any point leaves the previous export, no export (no
index), or the new one, never a mix.

Damage is detected: every file the framework writes carries in its safetensors header the
SHA-256 of its header (less that field) and tensor bytes together (``__metadata__["sha256_with_header"]``:
a dtype or shape edited in the header is caught) and, for older readers, of its tensor bytes alone
(``__metadata__["sha256"]``); a sharded index carries the SHA-256 of every shard file
(``metadata["sha256"]``). :func:`load_safetensors` checks them when present (files written
elsewhere carry none and load as they are; files written before ``sha256_with_header`` have
their tensor bytes checked). A header or index larger than :data:`JSON_LIMIT` bytes, holding more
than :data:`JSON_CONTAINERS` brackets or nested deeper than :data:`JSON_DEPTH`, a shard named by
anything but a plain file name beside its index,
or a file too short for its header is refused (:class:`CorruptCheckpoint`) before it is parsed.
"""

import hashlib
import json
import logging
import posixpath
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from backends.checkpoint_io import CorruptCheckpoint, run_files
from framework.checkpoint import storage

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
ShardSize = Union[int, str, None]
JSON_LIMIT = 8 * 2**20
"""The largest safetensors header or sharded index read (bytes): ~80 bytes a tensor, so 100 000 tensors fit.
Smaller than safetensors' own 100 MB: parsing a 30 MB ``__metadata__`` took 29 s and 800 MB before."""
JSON_DEPTH = 8
"""The deepest nesting of ``[``/``{`` admitted in a header or an index (the format needs 3)."""
JSON_CONTAINERS = 1_000_000
"""The most ``[``/``{`` a header or an index may hold (counted in the raw bytes, strings included)."""
DIGEST_FIELD = "sha256_with_header"
PLAIN_SHARD = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors$")
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
    _remove_partials(fs, directory, stem)
    names = [f"{stem}-{number:05d}-of-{len(shards):05d}{SUFFIX}" for number in range(1, len(shards) + 1)]
    weight_map: Dict[str, str] = {}
    digests: Dict[str, str] = {}
    for shard_name, shard in zip(names, shards):  # the previous export stays whole meanwhile
        data = encode(shard)
        storage.write_atomically(fs, storage.join(directory, f".{shard_name}.partial"), data, serializer=_write_bytes)
        digests[shard_name] = hashlib.sha256(data).hexdigest()
        weight_map.update(dict.fromkeys(shard, shard_name))
    index_path = storage.join(directory, stem + INDEX_SUFFIX)
    if fs.exists(index_path):  # from here until the new index is written, there is no export
        fs.rm(index_path)
    for old_shard in _shards_of(fs, directory, stem):
        if posixpath.basename(old_shard) not in digests:
            fs.rm(old_shard)
    for shard_name in names:
        fs.mv(storage.join(directory, f".{shard_name}.partial"), storage.join(directory, shard_name))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total, "sha256": digests}, "weight_map": weight_map}
    storage.write_atomically(fs, index_path, json.dumps(index, indent=2).encode(), serializer=_write_bytes)
    return fs.unstrip_protocol(index_path)


def load_safetensors(path: str) -> Tuple[str, Dict[str, torch.Tensor]]:
    """``(url, state_dict)`` from a ``.safetensors`` file or a ``.safetensors.index.json`` (every shard it names), on the CPU.

    Raises:
        FileNotFoundError: the file, or a shard the index names, is missing.
        CorruptCheckpoint: a file's bytes differ from the SHA-256 its header or the index records.

    Example:
        url, state_dict = load_safetensors("export/model.safetensors.index.json")
    """
    fs, target = storage.resolve(path)
    if not fs.exists(target):
        raise FileNotFoundError(f"{path!r}: no such safetensors file")
    if not target.endswith(INDEX_SUFFIX):
        data = run_files.read_bytes(fs, target, run_files.SAFETENSORS)
        return fs.unstrip_protocol(target), decode(data, fs.unstrip_protocol(target))
    where = fs.unstrip_protocol(target)
    index = bounded_json(run_files.read_bytes(fs, target, run_files.SAFETENSORS_INDEX), f"{where}: the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    recorded = (metadata.get("sha256") if isinstance(metadata, dict) else None) or {}
    if not isinstance(weight_map, dict) or not isinstance(recorded, dict):
        raise CorruptCheckpoint(f"{where}: not a safetensors index (a 'weight_map' of tensor name -> shard file)")
    for key, shard_name in weight_map.items():
        if not (isinstance(shard_name, str) and PLAIN_SHARD.match(shard_name)):
            raise CorruptCheckpoint(
                f"{where}: weight_map[{str(key)[:100]!r}] names {str(shard_name)[:100]!r}: refused (only a plain "
                f"*{SUFFIX} file name beside the index)"
            )
    directory = target.rpartition("/")[0]
    state: Dict[str, torch.Tensor] = {}
    for shard_name in dict.fromkeys(weight_map.values()):
        shard_path = storage.join(directory, shard_name)
        if not fs.isfile(shard_path):
            raise FileNotFoundError(f"{path!r} names the shard {shard_name!r}, which is missing")
        data = run_files.read_bytes(fs, shard_path, run_files.SAFETENSORS)
        if shard_name in recorded and hashlib.sha256(data).hexdigest() != recorded[shard_name]:
            raise CorruptCheckpoint(
                f"{path!r}: the shard {shard_name!r} does not match the SHA-256 its index records (damaged, or "
                "written by another export); export the weights again"
            )
        state.update(decode(data, fs.unstrip_protocol(shard_path)))
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


def encode(tensors: Dict[str, torch.Tensor]) -> bytes:
    """``tensors`` as safetensors bytes whose header records the SHA-256 of the tensor bytes.

    Example:
        >>> data = encode({"w": torch.ones(2)})
        >>> decode(data, "w.safetensors")["w"]
        tensor([1., 1.])
        >>> flipped = data[:-1] + bytes([data[-1] ^ 1])
        >>> decode(flipped, "w.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CorruptCheckpoint: w.safetensors: its header and tensor bytes do not match the SHA-256 ...
    """
    from safetensors.torch import save

    body = _tensor_bytes(save(tensors))  # the tensor bytes do not depend on the header's metadata
    metadata = {"format": "pt", "sha256": hashlib.sha256(body).hexdigest()}
    first = save(tensors, metadata=metadata)
    header = json.loads(first[8 : 8 + int.from_bytes(first[:8], "little")])
    return save(tensors, metadata={**metadata, DIGEST_FIELD: _whole_digest(header, body)})


def decode(data: bytes, where: str) -> Dict[str, torch.Tensor]:
    """The tensors in safetensors ``data`` (read from ``where``), checked against the SHA-256 in its header if any.

    Raises:
        CorruptCheckpoint: the header or the tensor bytes differ from the recorded SHA-256; the file is
            shorter than its header says; the header is larger than :data:`JSON_LIMIT` or nested deeper
            than :data:`JSON_DEPTH`; safetensors cannot read it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    header_size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if JSON_LIMIT < header_size <= len(data) - 8:
        raise CorruptCheckpoint(
            f"{where}: its safetensors header is {header_size} bytes, more than the {JSON_LIMIT} read "
            "(a header describes tensors: ~80 bytes each): refused"
        )
    if not 0 <= header_size <= min(len(data) - 8, JSON_LIMIT):
        raise CorruptCheckpoint(
            f"{where}: {len(data)} bytes, too short for its safetensors header ({header_size} bytes; at most "
            f"{JSON_LIMIT} admitted): truncated or not a safetensors file"
        )
    header = bounded_json(data[8 : 8 + header_size], f"{where}: its safetensors header")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    metadata = metadata if isinstance(metadata, dict) else {}
    if DIGEST_FIELD in metadata:
        if _whole_digest(header, _tensor_bytes(data)) != metadata[DIGEST_FIELD]:
            raise CorruptCheckpoint(f"{where}: its header and tensor bytes do not match the SHA-256 in its header (damaged)")
    elif metadata.get("sha256") is not None and hashlib.sha256(_tensor_bytes(data)).hexdigest() != metadata["sha256"]:
        raise CorruptCheckpoint(f"{where}: its tensor bytes do not match the SHA-256 in its header (damaged)")
    try:
        return load(data)
    except SafetensorError as error:
        raise CorruptCheckpoint(f"{where}: safetensors cannot read it ({str(error)[:200]})") from error


def bounded_json(data: bytes, what: str) -> Any:
    """``json.loads(data)``, refused when it holds more than :data:`JSON_CONTAINERS` brackets (counted before
    parsing) or nests deeper than :data:`JSON_DEPTH` (json's C parser stops deep nesting with ``RecursionError``,
    caught; the parsed value is then walked without recursion).

    Raises:
        CorruptCheckpoint: naming ``what``: nested too deep, or not JSON.

    Example:
        >>> bounded_json(b'{"a": [1, 2]}', "header")
        {'a': [1, 2]}
        >>> bounded_json(b"[" * 100000 + b"]" * 100000, "header")
        Traceback (most recent call last):
        ...
        backends.checkpoint_io.errors.CorruptCheckpoint: header is nested deeper than 8 levels: refused
    """
    containers = data.count(b"[") + data.count(b"{")  # C-speed counts, before anything is built
    if containers > JSON_CONTAINERS:
        raise CorruptCheckpoint(f"{what} holds {containers} brackets, more than {JSON_CONTAINERS}: refused")
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise CorruptCheckpoint(f"{what} is nested deeper than {JSON_DEPTH} levels: refused") from None
    except ValueError as error:  # UnicodeDecodeError included
        raise CorruptCheckpoint(f"{what} is unreadable ({str(error)[:200]})") from error
    stack = [(value, 1)]
    while stack:  # at most JSON_CONTAINERS containers: bounded
        item, depth = stack.pop()
        if depth > JSON_DEPTH:
            raise CorruptCheckpoint(f"{what} is nested deeper than {JSON_DEPTH} levels: refused")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def _whole_digest(header: Dict[str, Any], body: bytes) -> str:
    """SHA-256 of ``header`` (less :data:`DIGEST_FIELD`, keys sorted) and then ``body``."""
    metadata = {key: value for key, value in (header.get("__metadata__") or {}).items() if key != DIGEST_FIELD}
    canonical = {**{key: value for key, value in header.items() if key != "__metadata__"}, "__metadata__": metadata}
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())
    digest.update(body)
    return digest.hexdigest()


def _tensor_bytes(data: bytes) -> bytes:
    return data[8 + int.from_bytes(data[:8], "little") :]


def _write(fs: Any, path: str, tensors: Dict[str, torch.Tensor]) -> None:
    storage.write_atomically(fs, path, encode(tensors), serializer=_write_bytes)


def _shards_of(fs: Any, directory: str, stem: str) -> List[str]:
    """The shard files of a sharded export named ``stem`` in ``directory``."""
    pattern = re.compile(rf"^{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(SUFFIX)}$")
    return [path for path in storage.list_entries(fs, directory) if pattern.match(posixpath.basename(path))]


def _remove_partials(fs: Any, directory: str, stem: str) -> None:
    """Shards staged by an export that was killed before it moved them into place."""
    pattern = re.compile(rf"^\.{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(SUFFIX)}\.partial$")
    for path in storage.list_entries(fs, directory):
        if pattern.match(posixpath.basename(path)):
            fs.rm(path)


def _write_bytes(data: Any, handle: Any) -> None:
    handle.write(data)


def _remove_stale_index(fs: Any, index_path: str) -> None:
    """A single file replaces an earlier sharded export of the same name: its index would mislead."""
    if fs.exists(index_path):
        fs.rm(index_path)
        logger.info("removed %s from an earlier sharded export", index_path)
