"""Plain local paths without fsspec: the part of fsspec's filesystem interface checkpoints use.

Importing fsspec costs 30-110 ms at start-up (it reads every installed package's entry points,
and the objects that creates set off a full garbage collection over torch's modules), which a
run pays before its first step although most runs only ever touch the local disk. A plain path
or ``file://`` URL (no other protocol, no ``::`` chain) is served here with ``os`` and ``shutil``, with
fsspec's ``LocalFileSystem`` semantics (absolute ``/``-separated paths, ``file://`` URLs);
everything else still goes through fsspec.
"""

import os
import shutil
from typing import IO, Any, Dict, List, Optional, Tuple, Union


def local_path(url: str) -> Optional[str]:
    """The absolute path that ``url`` names on the local disk, as fsspec's local filesystem
    names it (``~`` expanded, no trailing ``/``), or None when ``url`` is for fsspec to resolve
    (another protocol, a ``::`` chain, a ``:`` in the path, a non-POSIX system).

    Example:
        >>> local_path("/tmp/run/"), local_path("file:///tmp/run"), local_path("s3://bucket/run")
        ('/tmp/run', '/tmp/run', None)
    """
    path = url[len("file://") :] if url.startswith("file://") else url
    if ":" in path or os.sep != "/":
        return None
    if path.startswith("~"):
        path = os.path.expanduser(path)
    elif not path.startswith("/"):
        path = f"{os.getcwd()}/{path[2:] if path.startswith('./') else '' if path == '.' else path}"
    return path.rstrip("/") or "/"


class LocalFiles:
    """The local disk, answering the fsspec ``AbstractFileSystem`` calls the checkpoint code makes.

    Example:
        >>> files = LocalFiles()
        >>> files.unstrip_protocol("/tmp/run/checkpoint-000000001.pt")
        'file:///tmp/run/checkpoint-000000001.pt'
    """

    protocol: Tuple[str, ...] = ("file", "local")

    def open(self, path: str, mode: str = "rb", **options: Any) -> IO[Any]:
        """Refused: read and write run files through :mod:`backends.checkpoint_io.run_files`
        (regular files only, never through a link), which serves the local disk itself."""
        raise NotImplementedError(f"open {path!r} through backends.checkpoint_io.run_files, not LocalFiles.open")

    def ls(self, path: str, detail: bool = False) -> Union[List[str], List[Dict[str, Any]]]:
        with os.scandir(path) as entries:
            found = [(f"{path.rstrip('/')}/{entry.name}", entry) for entry in entries]
        if not detail:
            return [name for name, _ in found]
        return [{"name": name, "type": _entry_type(entry), "islink": entry.is_symlink()} for name, entry in found]

    def invalidate_cache(self, path: Union[str, None] = None) -> None:
        """Nothing to forget: listings are never cached."""

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def mv(self, source: str, target: str, recursive: bool = False) -> None:
        shutil.move(source, target)

    def rm(self, path: str, recursive: bool = False) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            if not recursive:
                raise IsADirectoryError(f"{path} is a directory; pass recursive=True to remove it")
            shutil.rmtree(path)
        else:
            os.remove(path)

    def unstrip_protocol(self, path: str) -> str:
        return f"file://{path}"


def _entry_type(entry: "os.DirEntry[str]") -> str:
    """The entry's own type: a symbolic link is ``"link"``, whatever it points to."""
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    return "file" if entry.is_file(follow_symlinks=False) else "other"
