"""Locations: local paths and fsspec URLs, and what is done with one file or folder at a location.

A location is a string (or path-like): a local path (or ``file://`` URL) or a URL of another filesystem. Local paths
use the operating system directly; anything else goes through fsspec (s3fs for ``s3://``). S3 credentials, region
and endpoint come from the usual AWS sources (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``,
the instance or pod role, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``): botocore reads
them, nothing is passed here. The choice between the two is made here and nowhere else in the package.

Listings are never served from fsspec's cache: other processes and nodes write the files.
"""

from __future__ import annotations

import errno
import glob as globlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

Location = str | os.PathLike[str]
_T = TypeVar("_T")

# Where a hard link fails and a copy is made instead (another filesystem, or one without links).
LINK_FALLBACK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES)


def is_remote(location: Location) -> bool:
    """True for a URL of another filesystem than the local one (``s3://...``); False for a path or file://."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def local_path(location: Location) -> Path:
    """The local path of a location; ValueError naming it if it is a URL of another filesystem."""
    if is_remote(location):
        raise ValueError(f"{os.fspath(location)} is not on the local filesystem")
    return Path(os.fspath(location).removeprefix("file://"))


def join(base: Location, *names: str) -> str:
    """``base/name/...`` for a local path or a URL (a URL keeps its scheme and ``/`` separators)."""
    if is_remote(base):
        return "/".join([os.fspath(base).rstrip("/"), *names])
    return str(local_path(base).joinpath(*names))


def name_of(location: Location) -> str:
    """The last component of a location (``part-00000.parquet``)."""
    return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]


def as_uri(location: Location) -> str:
    """A URL of the location: ``file:///abs/path`` for a local one, the URL itself otherwise."""
    return os.fspath(location) if is_remote(location) else local_path(location).resolve().as_uri()


def filesystem(location: Location) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of a URL and the path inside it, with its listing cache emptied."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.fspath(location))
    fs.invalidate_cache()  # another process or node may have written or deleted files since
    return fs, path


def check_root(root: Location) -> None:
    """Raise ConfigError, naming the root and how to fix it, if the storage root cannot be used: a local root
    that is a file, that does not exist (the commands that call this read what landed there) or that cannot be
    written; an object store without credentials, whose bucket is
    missing, or that refuses access. Entry points call it first, so that a mistyped root is one line, not a
    traceback from deep inside a step."""
    from core.failures import ConfigError

    text = os.fspath(root)
    fix = "set storage_root in the platform configuration, PINFLOW_STORAGE_ROOT or --root"
    if not is_remote(text):
        path = local_path(text)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"storage root {text} is a file, not a folder: {fix} to a folder")
        if not path.exists():  # what validation and the build read lands there first: a mistyped root, most likely
            raise ConfigError(f"storage root {text} does not exist (nothing has landed there): {fix} to the folder "
                              "the raw partitions land in")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"storage root {text} is not writable by this user: {fix} to a folder it can "
                              "write, or change the folder's permissions") from None
        return
    import fsspec

    scheme = text.split("://", 1)[0]
    try:
        # A filesystem of its own: one made without credentials must not stay in fsspec's cache for later calls.
        fs, key = fsspec.core.url_to_fs(text, skip_instance_cache=True)
    except (ImportError, ValueError) as e:  # an unknown scheme, or its filesystem package not installed
        raise ConfigError(f"storage root {text}: {scheme}:// cannot be opened ({e}): {fix}") from None
    bucket = key.split("/", 1)[0]
    try:
        fs.ls(key, detail=False)  # the root's prefix: what a role limited to it may list
    except FileNotFoundError:  # a new root (nothing under it yet), or no such bucket
        try:
            missing = not fs.exists(bucket)
        except PermissionError:  # cannot look at the bucket itself: the first write will tell
            missing = False
        if missing:
            raise ConfigError(f"storage root {text}: the bucket {bucket} does not exist: create it or {fix}") from None
    except PermissionError as e:
        raise ConfigError(f"storage root {text}: access denied ({e}): grant this role s3:ListBucket, GetObject, "
                          "PutObject and DeleteObject on it") from None
    except Exception as e:
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            raise ConfigError(
                f"storage root {text}: no AWS credentials ({e}): set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or run with an instance or pod role; for another S3 endpoint also "
                "AWS_ENDPOINT_URL_S3") from None
        raise


def dispatch(location: Location, local: Callable[[Path], _T], remote: Callable[[AbstractFileSystem, str], _T]) -> _T:
    """``local(path)`` for a local location, else ``remote(filesystem, path in it)``."""
    if not is_remote(location):
        return local(local_path(location))
    fs, key = filesystem(location)
    return remote(fs, key)


def exists(location: Location) -> bool:
    return dispatch(location, Path.exists, lambda fs, key: bool(fs.exists(key)))


def is_dir(location: Location) -> bool:
    """A local folder, or a prefix holding at least one object."""
    return dispatch(location, Path.is_dir, lambda fs, key: bool(fs.isdir(key)))


def read_bytes(location: Location) -> bytes:
    """The bytes of a file; FileNotFoundError if it is not there."""
    return dispatch(location, Path.read_bytes, lambda fs, key: bytes(fs.cat_file(key)))


def read_text(location: Location) -> str:
    return read_bytes(location).decode()


def read_json(location: Location) -> Any:
    return json.loads(read_bytes(location))


def read_settings(location: Location, what: str) -> dict[str, Any]:
    """A settings file an operator wrote for its job (RUN.json, BUILD.json): a JSON object; a ConfigError naming
    ``what`` and the file when it is missing, not JSON, or not an object."""
    from core.failures import ConfigError

    try:
        data = read_json(location)
    except FileNotFoundError:
        raise ConfigError(f"{what} {location} does not exist") from None
    except ValueError as err:
        raise ConfigError(f"{what} {location} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {location} must hold a JSON object, got {type(data).__name__}")
    return data


def write_bytes(location: Location, data: bytes) -> None:
    """Write a file so that readers see the old one or the new one, never half of one.

    Locally through a temporary sibling and a rename; on an object store as one PUT.
    """
    if is_remote(location):
        fs, key = filesystem(location)
        fs.pipe_file(key, data)
        return
    path = local_path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(location: Location, text: str) -> None:
    write_bytes(location, text.encode())


def write_json(location: Location, payload: Any) -> None:
    write_bytes(location, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


@contextmanager
def open_output(location: Location) -> Iterator[IO[bytes]]:
    """A file opened for writing (a Parquet writer's sink). Not atomic by itself: use it inside :func:`publish`."""
    if is_remote(location):
        fs, key = filesystem(location)
        with fs.open(key, "wb") as f:
            yield f
        return
    path = local_path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        yield f


def remove(location: Location) -> None:
    """Delete a file; nothing happens if it is not there."""
    if not is_remote(location):
        local_path(location).unlink(missing_ok=True)
        return
    fs, key = filesystem(location)
    try:
        fs.rm_file(key)
    except FileNotFoundError:
        pass


def remove_tree(location: Location) -> None:
    """Delete a folder (every object under the prefix) and all it holds; nothing happens if it is not there."""
    if not is_remote(location):
        shutil.rmtree(local_path(location), ignore_errors=True)
        return
    fs, key = filesystem(location)
    if fs.exists(key):
        try:
            fs.rm(key, recursive=True)
        except FileNotFoundError:  # removed meanwhile by another process
            pass


def last_modified(folder: Location) -> float | None:
    """When anything under ``folder`` was last written (Unix seconds; a local folder's own entries count, so a
    build that made its folders but wrote no file yet is recent); None if there is nothing."""
    if not is_remote(folder):
        path = local_path(folder)
        times = []
        for entry in [path, *path.rglob("*")] if path.exists() else []:
            try:
                times.append(entry.stat().st_mtime)
            except FileNotFoundError:  # removed meanwhile
                continue
        return max(times, default=None)
    fs, key = filesystem(folder)
    try:
        entries = fs.find(key, detail=True).values()
    except FileNotFoundError:
        return None
    times = []
    for entry in entries:
        if entry.get("type") == "file":
            stamp = entry.get("LastModified") or entry.get("mtime") or fs.modified(entry["name"])
            times.append(stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp))
    return max(times, default=None)


def modified(location: Location) -> float | None:
    """When a file was last written by the storage's own clock (a local file's mtime, an object's LastModified), in
    Unix seconds; None if it is not there."""
    if not is_remote(location):
        try:
            return local_path(location).stat().st_mtime
        except FileNotFoundError:
            return None
    fs, key = filesystem(location)
    try:
        stamp = fs.modified(key)
    except FileNotFoundError:
        return None
    return float(stamp.timestamp())


def make_dirs(location: Location) -> None:
    """Create a local folder and its parents; an object store has no folders to create."""
    if not is_remote(location):
        local_path(location).mkdir(parents=True, exist_ok=True)


def glob(base: Location, pattern: str) -> list[str]:
    """Locations (URLs keep their scheme) under ``base`` matching ``pattern`` (``*/x.json``), sorted.

    Only ``pattern`` is a pattern: ``*``, ``?`` or ``[`` in ``base`` match themselves.
    """
    return dispatch(
        base,
        lambda path: sorted(globlib.glob(os.path.join(globlib.escape(str(path)), pattern))),
        lambda fs, key: sorted(fs.unstrip_protocol(p) for p in fs.glob(f"{globlib.escape(key.rstrip('/'))}/{pattern}")),
    )


def list_names(base: Location) -> list[str]:
    """Names of the entries (files and folders) directly under ``base``, sorted; [] if it does not exist."""
    if not is_remote(base):
        path = local_path(base)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    fs, key = filesystem(base)
    try:
        return sorted(name_of(entry) for entry in fs.ls(key, detail=False))
    except FileNotFoundError:
        return []


def copy_tree(source: Location, target: Location) -> None:
    """Copy a folder and everything under it (between any two filesystems)."""
    for name in list_names(source):
        src, dst = join(source, name), join(target, name)
        if is_dir(src):
            copy_tree(src, dst)
        else:
            write_bytes(dst, read_bytes(src))


def copy_file(source: Location, target: Location) -> None:
    """Copy one file into a folder being published: a hard link on a local filesystem (published files are never
    changed in place, so sharing them is safe), a server-side copy on an object store, else read and write."""
    if not is_remote(source) and not is_remote(target):
        try:
            os.link(local_path(source), local_path(target))
            return
        except OSError as err:
            if err.errno not in LINK_FALLBACK_ERRNOS:
                raise
    elif is_remote(source) and is_remote(target) and filesystem(source)[0] is filesystem(target)[0]:
        fs = filesystem(source)[0]
        fs.copy(filesystem(source)[1], filesystem(target)[1])
        return
    with open_output(target) as out:
        out.write(read_bytes(source))


def move_tree(source: Location, target: Location) -> None:
    """Move a folder: a rename on a local filesystem; copy then delete elsewhere (the source goes last)."""
    if not is_remote(source) and not is_remote(target):
        local_path(target).parent.mkdir(parents=True, exist_ok=True)
        local_path(source).rename(local_path(target))
        return
    copy_tree(source, target)
    remove_tree(source)
