"""Hostile and damaged checkpoints, generated: every load path x every backend x every damage kind.

Three registries make the cells: :data:`FORMATS` (what a backend writes and which backends read it
back), :data:`DAMAGES` (what is done to a copy of the newest checkpoint and the refusal expected) and
:data:`LOAD_PATHS` (how a run reads it: resume, ``validate(checkpoint=...)``, ``load_weights``,
``export_weights(checkpoint=...)``). Adding an entry to any registry adds its cells. Each format's
run is trained once (a module fixture); every cell damages its own copy.

Every payload (a pickle that would run ``open(marker, "w")``) leaves a marker file if it ever runs;
every cell asserts there is none. Expected: a damaged or misleading checkpoint is
:class:`CorruptCheckpoint` naming the entry or file (resume falls back to checkpoint 2, the previous
good one); a hostile pickle is :class:`CheckpointRefused` (resume stops, naming it). The 2-rank cells
(fsdp 2 ranks and model-parallel 1x2, in one process group) repeat the issue-39 attacks on resume and
``validate``.
"""

import os
import pickle
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from distributed import run_ranks
from toy import ToyModule, toy_args

from backends.checkpoint_io.dcp_index import IndexUnpickler
from backends.checkpoint_io.sharded_checkpoint import INDEX_FILE, STATE_FILE
from framework import Trainer
from framework.checkpoint import CheckpointRefused, CorruptCheckpoint, DefaultCheckpointerArguments, load_weights
from framework.checkpoint.default import checkpoint_name
from framework.checkpoint.safetensors_io import save_safetensors

STEPS = 3
MARKER = "PAYLOAD-RAN"


class Payload:
    """Unpickling it creates ``path``: what a hostile file would do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Tuple[Any, ...]:
        return (open, (self.path, "w"))


def arguments(root: str, backend: str, **overrides: Any) -> Any:
    checkpoints = DefaultCheckpointerArguments(save_every_n_steps=1, keep_last_n=None)
    values: Dict[str, Any] = dict(backend=backend, max_steps=STEPS, model_summary=False)
    return toy_args(root, checkpoints, **{**values, **overrides})


def newest(root: str, suffix: str) -> str:
    return os.path.join(root, "run", "checkpoints", checkpoint_name(STEPS, suffix))


# ---------------------------------------------------------------- sharded (DCP) damage


def read_index(directory: str) -> Any:
    with open(os.path.join(directory, INDEX_FILE), "rb") as handle:
        return IndexUnpickler(handle).load()


def rewrite(directory: str, metadata: Any = None) -> None:
    """Write ``metadata`` as the index and make every digest in ``state.pt`` match what is there now
    (an attacker who can write the directory can do this): only the reader's checks stand."""
    if metadata is not None:
        with open(os.path.join(directory, INDEX_FILE), "wb") as handle:
            pickle.dump(metadata, handle)
    import hashlib

    def digest(path: str) -> str:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()

    state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
    state["sharded"]["metadata_sha256"] = digest(os.path.join(directory, INDEX_FILE))
    try:
        names = {info.relative_path for info in read_index(directory).storage_data.values()}
        state["sharded"]["files_sha256"] = {name: digest(os.path.join(directory, name)) for name in names}
    except (pickle.UnpicklingError, FileNotFoundError, IsADirectoryError):
        pass  # a hostile index: its digest is enough
    torch.save(state, os.path.join(directory, STATE_FILE))


def a_weight(metadata: Any) -> str:
    return next(key for key in sorted(metadata.state_dict_metadata) if key.startswith("module/"))


def bytes_entry(directory: str, marker: str, key: str = "") -> None:
    """A tensor's entry declared ``BytesStorageMetadata``, its bytes a payload: DCP's default planner unpickles it."""
    metadata = read_index(directory)
    key = key or a_weight(metadata)
    payload = pickle.dumps(Payload(marker))
    with open(os.path.join(directory, "__9_0.distcp"), "wb") as handle:
        handle.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    rewrite(directory, metadata)


def pointed_elsewhere(directory: str, name: Callable[[str], str]) -> None:
    """Every storage entry names ``name(directory of checkpoint 2's shard)``: another checkpoint's weights."""
    metadata = read_index(directory)
    other = os.path.join(os.path.dirname(directory), checkpoint_name(STEPS - 1, ""))
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo(name(other) + "/" + info.relative_path, info.offset, info.length)
    rewrite(directory, metadata)


def offset_outside(directory: str, marker: str) -> None:
    metadata = read_index(directory)
    index, info = next(iter(metadata.storage_data.items()))
    size = os.path.getsize(os.path.join(directory, info.relative_path))
    metadata.storage_data[index] = _StorageInfo(info.relative_path, size + 10, info.length)
    rewrite(directory, metadata)


def huge_tensor(directory: str, marker: str) -> None:
    """A bias's entry claims 10**12 elements (a 4 TB allocation when read whole); its chunk stays as it was."""
    metadata = read_index(directory)
    entry = next(entry for key, entry in sorted(metadata.state_dict_metadata.items()) if len(entry.size) == 1)
    entry.size = torch.Size([10**12])
    rewrite(directory, metadata)


def symlinked_shard(directory: str, marker: str) -> None:
    """The shard replaced by a link to checkpoint 2's shard (a plain name, another file)."""
    shard = os.path.join(directory, "__0_0.distcp")
    os.remove(shard)
    os.symlink(os.path.join(os.path.dirname(directory), checkpoint_name(STEPS - 1, ""), "__0_0.distcp"), shard)
    rewrite(directory)


def deep_index(directory: str, marker: str) -> None:
    """The index's planner_data holds a list nested 100 000 levels deep (hand-made pickle opcodes)."""
    metadata = read_index(directory)
    metadata.planner_data = {"module/deep": "PLACEHOLDER-DEEP"}
    data = pickle.dumps(metadata, protocol=2)  # no frames: the opcodes may change length
    placeholder = b"X" + (16).to_bytes(4, "little") + b"PLACEHOLDER-DEEP"
    assert data.count(placeholder) == 1
    depth = 100_000
    with open(os.path.join(directory, INDEX_FILE), "wb") as handle:
        handle.write(data.replace(placeholder, b"]" * depth + b"a" * (depth - 1)))
    rewrite(directory)


def a_matrix(metadata: Any) -> str:
    return next(key for key, entry in sorted(metadata.state_dict_metadata.items()) if len(entry.size) == 2)


def overlapping_chunks(directory: str, marker: str) -> None:
    """A weight of R rows described as two chunks of R/2 rows at rows 0 and 2 (each stored, each of the right
    length; together the right element count): rows 2..3 twice, the last rows never read (uninitialised memory)."""
    import io

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = read_index(directory)
    key = a_matrix(metadata)
    entry = metadata.state_dict_metadata[key]
    rows, columns = entry.size
    half = torch.Size([rows // 2, columns])
    blobs, infos, offset = [], {}, 0
    for start in (0, 2):
        buffer = io.BytesIO()
        torch.save(torch.full(tuple(half), 1.0), buffer)
        blobs.append(buffer.getvalue())
        infos[torch.Size([start, 0])] = _StorageInfo("__9_0.distcp", offset, len(blobs[-1]))
        offset += len(blobs[-1])
    with open(os.path.join(directory, "__9_0.distcp"), "wb") as handle:
        handle.write(b"".join(blobs))
    entry.chunks = [ChunkStorageMetadata(offsets=start, sizes=half) for start in infos]
    metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}
    for start, info in infos.items():
        metadata.storage_data[MetadataIndex(key, start)] = info
    rewrite(directory, metadata)


def chunk_referenced_often(directory: str, marker: str) -> None:
    """A weight described as one single-element chunk at its origin, listed once per element: the element count
    adds up and the stored bytes suffice, so the old check passed it and DCP read one element per reference
    (the issue's 60 000 references in a 123 KB index: 192 s), the rest never written."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = read_index(directory)
    entry = metadata.state_dict_metadata[a_matrix(metadata)]
    one = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 1]))
    entry.chunks = [one] * (entry.size[0] * entry.size[1])
    rewrite(directory, metadata)


def deep_state(directory: str, marker: str) -> None:
    """``state.pt`` holding a list nested 30 000 levels deep (hand-made pickle opcodes in its archive):
    a recursive walk of the state was a RecursionError that stopped the resume."""
    import zipfile

    path = os.path.join(directory, STATE_FILE)
    state = torch.load(path, weights_only=True)
    state["deep"] = "PLACEHOLDER-DEEP"
    torch.save(state, path)
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    placeholder = b"X" + (16).to_bytes(4, "little") + b"PLACEHOLDER-DEEP"
    depth = 30_000
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            if info.filename.endswith("/data.pkl"):
                assert data.count(placeholder) == 1
                data = data.replace(placeholder, b"]" * depth + b"a" * (depth - 1))
            archive.writestr(info, data)


def hostile_index(directory: str, marker: str) -> None:
    with open(os.path.join(directory, INDEX_FILE), "wb") as handle:
        pickle.dump(Payload(marker), handle)
    rewrite(directory)


def flip_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        value = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([value ^ 0x40]))


def truncate(path: str, keep: float = 0.5) -> None:
    os.truncate(path, int(os.path.getsize(path) * keep))


def payload_state(path: str, marker: str) -> None:
    torch.save({"format": "x", "payload": Payload(marker)}, path)


# ---------------------------------------------------------------- safetensors damage


def special_file(path: str, kind: str) -> None:
    """``path`` replaced by a FIFO (a read would block forever), a link to ``/dev/zero`` (a whole-file
    read would fill memory) or a link out of the run (to the run's own older, intact file). A link the
    user names (``checkpoint=``) is followed on purpose; one the run finds in its directories is refused."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        outside = path + ".outside"
        os.replace(path, outside)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        os.symlink(path + ".outside", path)


def older_under_newer_name(path: str) -> None:
    """The newest checkpoint replaced by a copy of the first one, under the newest's name."""
    oldest = os.path.join(os.path.dirname(path), checkpoint_name(1, os.path.splitext(path)[1]))
    (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
    (shutil.copytree if os.path.isdir(oldest) else shutil.copy)(oldest, path)


ODD = r"is (a FIFO|a symbolic link|a device), not a regular file"


def header_edit(path: str) -> None:
    """One weight's dtype F32 -> I32 (same size): values off by ~1e9 if it loaded."""
    with open(path, "rb") as handle:
        data = handle.read()
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].replace(b'"F32"', b'"I32"', 1)
    with open(path, "wb") as handle:
        handle.write(data[:8] + header + data[8 + size :])


def deep_header(path: str) -> None:
    header = b"[" * 200_000 + b"]" * 200_000
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)


def metadata_edit(path: str, value: str) -> None:
    """The header's ``__metadata__`` gets a field holding ``value`` (raw JSON): what a hand-edited file can say."""
    import json

    with open(path, "rb") as handle:
        data = handle.read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"]["extra"] = "PLACEHOLDER"
    text = json.dumps(header).replace('"PLACEHOLDER"', value).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text + data[8 + size :])


def index_edit(path: str, edit: Callable[[Dict[str, Any]], Any]) -> None:
    import json

    with open(path) as handle:
        index = json.load(handle)
    with open(path, "w") as handle:
        handle.write(edit(index))


def escape_index(index: Dict[str, Any]) -> str:
    import json

    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere/" + index["weight_map"][key]
    return json.dumps(index)


# ---------------------------------------------------------------- the registries


@dataclass(frozen=True)
class Format:
    writer: str  # the backend that trains the run
    readers: Tuple[str, ...]  # the backends whose trainers read it back
    target: Callable[[str], str]  # the path a load path is given, in a copied run


FORMATS: Dict[str, Format] = {
    "pt": Format("sp", ("sp",), lambda root: newest(root, ".pt")),
    "sharded": Format("fsdp", ("fsdp", "sp"), lambda root: newest(root, "")),
    "safetensors": Format("sp", ("sp",), lambda root: os.path.join(root, "export", "model.safetensors")),
    "safetensors-index": Format(
        "sp", ("sp",), lambda root: os.path.join(root, "export", "sharded", "model.safetensors.index.json")
    ),
}


@dataclass(frozen=True)
class Damage:
    format: str
    apply: Callable[[str, str], None]  # (the target path, the marker a payload would write)
    refusal: type
    message: str  # a regex the error matches: it names the entry or file


DAMAGES: Dict[str, Damage] = {
    "sharded-bytes-entry": Damage("sharded", bytes_entry, CorruptCheckpoint, r"is a BytesStorageMetadata, not a tensor"),
    "sharded-bytes-entry-new-key": Damage(
        "sharded",
        lambda d, m: bytes_entry(d, m, key="module/extra"),
        CorruptCheckpoint,
        r"'module/extra' was not written as a tensor",
    ),
    "sharded-path-escape": Damage(
        "sharded",
        lambda d, m: pointed_elsewhere(d, lambda other: "../" + os.path.basename(other)),
        CorruptCheckpoint,
        r"names the file '\.\./checkpoint-000000002/__0_0\.distcp': refused",
    ),
    "sharded-absolute-path": Damage(
        "sharded", lambda d, m: pointed_elsewhere(d, lambda other: other), CorruptCheckpoint, r"names the file '/.*: refused"
    ),
    "sharded-symlinked-shard": Damage(
        "sharded", symlinked_shard, CorruptCheckpoint, r"names '__0_0\.distcp', which is not in the checkpoint directory"
    ),
    "sharded-offset-outside": Damage("sharded", offset_outside, CorruptCheckpoint, r"lie outside '__0_0\.distcp'"),
    "sharded-huge-tensor": Damage("sharded", huge_tensor, CorruptCheckpoint, r"not the 1000000000000 of"),
    "sharded-shard-truncated": Damage(
        "sharded", lambda d, m: truncate(os.path.join(d, "__0_0.distcp")), CorruptCheckpoint, r"lie outside|SHA-256"
    ),
    "sharded-shard-flipped": Damage(
        "sharded",
        lambda d, m: flip_byte(os.path.join(d, "__0_0.distcp")),
        CorruptCheckpoint,
        r"shard '__0_0\.distcp' does not match the SHA-256",
    ),
    "sharded-index-truncated": Damage(
        "sharded", lambda d, m: truncate(os.path.join(d, INDEX_FILE)), CorruptCheckpoint, r"\.metadata does not match"
    ),
    "sharded-overlapping-chunks": Damage(
        "sharded", overlapping_chunks, CorruptCheckpoint, r"its chunk at \(2, 0\) overlaps another chunk"
    ),
    "sharded-chunk-referenced-per-element": Damage(
        "sharded", chunk_referenced_often, CorruptCheckpoint, r"more chunks than its \d+ storage entries"
    ),
    "sharded-state-deep-nesting": Damage("sharded", deep_state, CorruptCheckpoint, r"state\.pt nests deeper than 100 levels"),
    "sharded-index-deep-nesting": Damage("sharded", deep_index, CorruptCheckpoint, r"planner_data holds list under str"),
    "sharded-index-payload": Damage("sharded", hostile_index, CheckpointRefused, r"not a plain DCP index.*io\.open"),
    "sharded-state-payload": Damage(
        "sharded", lambda d, m: payload_state(os.path.join(d, STATE_FILE), m), CheckpointRefused, r"pickled Python objects"
    ),
    "sharded-index-fifo": Damage(
        "sharded", lambda d, m: special_file(os.path.join(d, INDEX_FILE), "fifo"), CorruptCheckpoint, ODD
    ),
    "sharded-index-dev-zero": Damage(
        "sharded", lambda d, m: special_file(os.path.join(d, INDEX_FILE), "dev-zero"), CorruptCheckpoint, ODD
    ),
    "sharded-state-fifo": Damage(
        "sharded", lambda d, m: special_file(os.path.join(d, STATE_FILE), "fifo"), CorruptCheckpoint, ODD
    ),
    "sharded-state-link-out": Damage(
        "sharded", lambda d, m: special_file(os.path.join(d, STATE_FILE), "link"), CorruptCheckpoint, ODD
    ),
    "sharded-named-newer": Damage(
        "sharded", lambda d, m: older_under_newer_name(d), CorruptCheckpoint, r"is named for step 3 but holds step 1"
    ),
    "pt-fifo": Damage("pt", lambda p, m: special_file(p, "fifo"), CorruptCheckpoint, ODD),
    "pt-dev-zero": Damage("pt", lambda p, m: special_file(p, "dev-zero"), CorruptCheckpoint, ODD),
    "pt-named-newer": Damage(
        "pt", lambda p, m: older_under_newer_name(p), CorruptCheckpoint, r"is named for step 3 but holds step 1"
    ),
    "safetensors-fifo": Damage("safetensors", lambda p, m: special_file(p, "fifo"), CorruptCheckpoint, ODD),
    "safetensors-dev-zero": Damage("safetensors", lambda p, m: special_file(p, "dev-zero"), CorruptCheckpoint, ODD),
    "pt-truncated": Damage("pt", lambda p, m: truncate(p), CorruptCheckpoint, r"truncated"),
    "pt-flipped": Damage("pt", lambda p, m: flip_byte(p), CorruptCheckpoint, r"CRC|damaged|unpickling failed"),
    "pt-payload": Damage("pt", payload_state, CheckpointRefused, r"pickled Python objects"),
    "safetensors-header-edit": Damage(
        "safetensors", lambda p, m: header_edit(p), CorruptCheckpoint, r"header and tensor bytes do not match the SHA-256"
    ),
    "safetensors-deep-nesting": Damage("safetensors", lambda p, m: deep_header(p), CorruptCheckpoint, r"nested deeper than"),
    "safetensors-30mb-metadata": Damage(
        "safetensors",
        lambda p, m: metadata_edit(p, '"' + "x" * (30 << 20) + '"'),
        CorruptCheckpoint,
        r"its safetensors header is 314\d{5} bytes, more than the 8388608 read",
    ),
    "safetensors-many-brackets": Damage(
        "safetensors",
        lambda p, m: metadata_edit(p, "[" + ",".join(["[]"] * 2_000_000) + "]"),
        CorruptCheckpoint,
        r"holds 20000\d\d brackets, more than 1000000: refused",
    ),
    "safetensors-truncated": Damage("safetensors", lambda p, m: truncate(p, 0.01), CorruptCheckpoint, r"truncated"),
    "safetensors-index-escape": Damage(
        "safetensors-index", lambda p, m: index_edit(p, escape_index), CorruptCheckpoint, r"names '\.\./elsewhere/.*refused"
    ),
    "safetensors-index-deep-nesting": Damage(
        "safetensors-index",
        lambda p, m: index_edit(p, lambda index: "[" * 200_000 + "]" * 200_000),
        CorruptCheckpoint,
        r"the index is nested deeper than",
    ),
}


def resume(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    args = arguments(root, backend, **{**extra, "max_steps": STEPS + 1})
    args.checkpointer_args.resume = "auto"
    trainer = Trainer(make(), args)
    trainer.train()
    return str(trainer.checkpointer.loaded_from)


def validate(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    Trainer(make(), arguments(root, backend, **extra)).validate(checkpoint=target)
    return target


def run_test(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    Trainer(evaluating(make()), arguments(root, backend, **extra)).test(checkpoint=target)
    return target


def predict(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    Trainer(evaluating(make()), arguments(root, backend, **extra)).predict(checkpoint=target)
    return target


def evaluating(module: Any) -> Any:
    """``module`` with test and predict loaders (its validation set)."""
    module.get_test_dataloaders = module.get_val_dataloaders
    module.get_predict_dataloader = lambda sampler, batch_size: module.get_val_dataloaders(sampler, batch_size)
    module.predict_step = lambda global_step, batch, device: module.net(batch[0])
    return module


def export(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    Trainer(make(), arguments(root, backend, **extra)).export_weights(os.path.join(root, "out.safetensors"), checkpoint=target)
    return target


def weights(root: str, target: str, backend: str, make: Callable[[], Any] = ToyModule, **extra: Any) -> str:
    return load_weights(make(), target)


@dataclass(frozen=True)
class LoadPath:
    run: Callable[..., str]  # (copied run, target, backend[, module factory, **arguments]) -> the checkpoint it loaded
    formats: Tuple[str, ...]
    falls_back: bool = False  # damage makes it load the previous checkpoint instead
    with_backend: bool = True  # False: reads in this process alone, whatever backend wrote it


LOAD_PATHS: Dict[str, LoadPath] = {
    "resume": LoadPath(resume, ("pt", "sharded"), falls_back=True),
    "validate": LoadPath(validate, tuple(FORMATS)),
    "test": LoadPath(run_test, tuple(FORMATS)),
    "predict": LoadPath(predict, tuple(FORMATS)),
    "export_weights": LoadPath(export, ("pt", "sharded")),
    "load_weights": LoadPath(weights, tuple(FORMATS), with_backend=False),
}


def cells() -> List[Any]:
    found = []
    for path_name, path in LOAD_PATHS.items():
        for damage_name, damage in DAMAGES.items():
            if damage.format not in path.formats:
                continue
            for backend in FORMATS[damage.format].readers if path.with_backend else ("none",):
                found.append(pytest.param(path_name, backend, damage_name, id=f"{path_name}-{backend}-{damage_name}"))
    return found


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Dict[str, str]:
    """One trained run per writing backend (checkpoints 1..3), and its exports (a file and a sharded one)."""
    roots = {}
    for backend in sorted({fmt.writer for fmt in FORMATS.values()}):
        root = str(tmp_path_factory.mktemp(f"written-{backend}"))
        trainer = Trainer(ToyModule(), arguments(root, backend))
        trainer.train()
        if backend == "sp":
            state = trainer.module.state_dict()
            save_safetensors(state, os.path.join(root, "export", "model.safetensors"))
            save_safetensors(state, os.path.join(root, "export", "sharded", "model.safetensors"), max_shard_size=100)
        roots[backend] = root
    return roots


@pytest.mark.parametrize("path_name, backend, damage_name", cells())
def test_every_load_path_refuses_every_damage_and_runs_no_payload(written, tmp_path, path_name, backend, damage_name):
    damage, path = DAMAGES[damage_name], LOAD_PATHS[path_name]
    fmt = FORMATS[damage.format]
    root = str(tmp_path / "copy")
    shutil.copytree(written[fmt.writer], root, symlinks=True)
    marker = str(tmp_path / MARKER)
    target = fmt.target(root)
    damage.apply(target, marker)
    assert outcome(path_name, damage_name, lambda: path.run(root, target, backend), target) == "as expected"
    assert not os.path.exists(marker), "the payload ran"


def outcome(path_name: str, damage_name: str, run: Callable[[], str], target: str) -> str:
    """``"as expected"``, or what happened instead: resume falls back past damage to checkpoint 2, every other
    load path (and resume, for a hostile pickle) raises the damage's refusal with its message."""
    damage, path = DAMAGES[damage_name], LOAD_PATHS[path_name]
    falls_back = path.falls_back and damage.refusal is CorruptCheckpoint
    try:
        loaded = run()
    except Exception as error:
        if not falls_back and isinstance(error, damage.refusal) and re.search(damage.message, str(error)):
            return "as expected"
        return f"{type(error).__name__}: {error}"
    if falls_back and loaded.endswith(checkpoint_name(STEPS - 1, os.path.splitext(target)[1])):
        return "as expected"
    return f"loaded {loaded}"


def test_every_damage_kind_has_cells_on_every_path_that_reads_its_format():
    ids = {cell.id for cell in cells()}
    for damage_name, damage in DAMAGES.items():
        readers = [name for name, path in LOAD_PATHS.items() if damage.format in path.formats]
        assert len(readers) >= 2 and all(any(i.startswith(f"{r}-") and i.endswith(damage_name) for i in ids) for r in readers)


def test_a_sharded_checkpoint_written_before_shard_digests_loads_and_its_index_is_still_checked(written, tmp_path):
    """``state.pt`` without ``files_sha256`` (written before shards were digested): it loads, with the same
    weights; a bytes entry in it is still refused and its payload never runs."""
    root = str(tmp_path / "copy")
    shutil.copytree(written["fsdp"], root)
    target, marker = newest(root, ""), str(tmp_path / MARKER)

    def forget_shard_digests() -> None:
        state = torch.load(os.path.join(target, STATE_FILE), weights_only=True)
        del state["sharded"]["files_sha256"]
        torch.save(state, os.path.join(target, STATE_FILE))

    expected = ToyModule(seed=1)
    load_weights(expected, target)
    forget_shard_digests()
    module = ToyModule(seed=1)
    load_weights(module, target)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), expected.state_dict().values()))
    assert not torch.equal(module.net[0].weight, ToyModule(seed=1).net[0].weight)  # loaded, not the initial weights
    bytes_entry(target, marker)
    forget_shard_digests()
    with pytest.raises(CorruptCheckpoint, match="is a BytesStorageMetadata, not a tensor"):
        load_weights(ToyModule(), target)
    assert not os.path.exists(marker)


def test_the_index_only_readers_of_dcp_index_refuse_bytes_entries_too(written, tmp_path):
    """``SafeFileSystemReader`` (kept for code that drives DCP itself) with DCP's default planner: the bytes
    entry is refused when read, its payload never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from backends.checkpoint_io.dcp_index import SafeFileSystemReader

    root = str(tmp_path / "copy")
    shutil.copytree(written["fsdp"], root)
    target, marker = newest(root, ""), str(tmp_path / MARKER)
    bytes_entry(target, marker)
    key = next(key for key, entry in read_index(target).state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata))
    with pytest.raises(CheckpointException, match="would be read as pickled bytes"):
        dcp.load({key: torch.empty(0)}, storage_reader=SafeFileSystemReader(target), no_dist=True)
    assert not os.path.exists(marker)


def llama() -> Any:
    """The model-parallel example's model, tiny (its tensor_parallel_plan splits the attention and the SwiGLU)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from model_parallel import LlamaArguments, TinyLlama

    sys.path.pop(0)
    torch.manual_seed(0)
    return TinyLlama(LlamaArguments(vocab_size=32, dim=32, n_layers=1, n_heads=4, hidden_dim=64, seq_len=8, samples=64))


TWO_RANK_BACKENDS: Dict[str, Tuple[Callable[[], Any], Dict[str, Any]]] = {
    "fsdp-2": (ToyModule, dict(backend="fsdp")),
    "model-parallel-1x2": (llama, dict(backend="model-parallel", tensor_parallel_size=2)),
}
TWO_RANK_PATHS = ("resume", "validate")


def two_rank_cells(rank: int, out: str) -> Dict[str, str]:
    """Every sharded damage kind x resume and validate x each 2-rank backend, in one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results: Dict[str, str] = {}
    for name, (make, extra) in TWO_RANK_BACKENDS.items():
        backend = extra["backend"]
        overrides = {key: value for key, value in extra.items() if key != "backend"}
        written_root = os.path.join(out, name, "written")
        Trainer(make(), arguments(written_root, backend, train_batch_size=16, **overrides)).train()
        for damage_name, damage in DAMAGES.items():
            if damage.format != "sharded":
                continue
            for path_name in TWO_RANK_PATHS:
                root = os.path.join(out, name, damage_name, path_name)
                target, marker = newest(root, ""), os.path.join(out, name, damage_name, path_name + "-" + MARKER)
                if rank == 0:
                    shutil.copytree(written_root, root, symlinks=True)
                    damage.apply(target, marker)
                dist.barrier()
                run = LOAD_PATHS[path_name].run
                results[f"{name}-{path_name}-{damage_name}"] = outcome(
                    path_name,
                    damage_name,
                    lambda: run(root, target, backend, make, train_batch_size=16, **overrides),  # noqa: B023
                    target,
                )
                dist.barrier()
                if os.path.exists(marker):
                    results[f"{name}-{path_name}-{damage_name}"] = "the payload ran"
    dist.destroy_process_group()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_two_rank_fsdp_and_model_parallel_refuse_every_sharded_damage_on_resume_and_validate(tmp_path):
    ranks = run_ranks(two_rank_cells, out=str(tmp_path), timeout=400)
    expected = {
        f"{name}-{path}-{damage}"
        for name in TWO_RANK_BACKENDS
        for path in TWO_RANK_PATHS
        for damage, kind in DAMAGES.items()
        if kind.format == "sharded"
    }
    for results in ranks:
        assert set(results) == expected
        assert {cell: result for cell, result in results.items() if result != "as expected"} == {}
