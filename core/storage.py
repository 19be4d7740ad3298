"""The storage root and everything under it (docs/architecture.md §2), on a local folder or any fsspec URL (``s3://...``).

Every location is a string: a local path (or ``file://`` URL) or a URL of another filesystem. Local paths
use the operating system directly; anything else goes through fsspec (s3fs for ``s3://``). S3 credentials,
region and endpoint come from the usual AWS sources (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_PROFILE``, the instance or pod role, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``): botocore reads them, nothing is passed here.

A partition is the folder ``<root>/<dataset>/ds=YYYY-MM-DD/``. It exists for readers only once its completion
marker ``_SUCCESS`` is there. **One publishing rule** makes every write atomic and idempotent:

* a folder (a partition, a report, a quarantine record) is written through :func:`publish`: on a local root
  into a hidden temporary sibling that is swapped into place with its marker (an atomic exchange on Linux, so
  a reader never finds the folder missing; writers of one folder take turns on its lock file), so a crash
  never leaves partial output and a rerun replaces exactly that folder; on an object store, which has no rename, the
  data goes into a fresh version folder ``<folder>/_v=<version>/`` (ids sort by time) and the marker, written last as
  one conditional PUT (only if the marker is still the one read: concurrent writers never move it back to an older
  version), names that version (``{"published": ..., "version": ...}``), so readers switch from the whole old version
  to the whole new one; the older versions are then removed once the one replaced had been published for
  ``SUPERSEDED_GRACE_SECONDS`` (readers that resolved them have had that long to finish), never the one replaced
  (kept for readers that had just resolved it) nor a newer one (a concurrent writer's); a failure removes its own
  version folder only;
* a single file (JSON, a report page) through :func:`write_bytes` / :func:`write_json`: locally a temporary
  sibling and a rename, on an object store one PUT, which S3 makes visible whole or not at all.

Readers find a folder's files through :func:`resolve` (:func:`partition_folder` for a partition): on an object
store the version folder its marker names (:func:`read_table` on a local root opens the folder once and its files
through that handle: one version, whatever a publish does meanwhile); a plain marker (not JSON naming a version: a partition an upstream
producer landed, or one written by older code) means the files directly in the folder, as on a local root.

Listings are never served from fsspec's cache: other processes and nodes write the files.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import glob as globlib
import hashlib
import json
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fsspec import AbstractFileSystem

MARKER = "_SUCCESS"
DATA_FILE = "part-00000.parquet"
METADATA_FILE = "_metadata.json"

Location = str | os.PathLike[str]
_T = TypeVar("_T")


# --- days ---------------------------------------------------------------------------------------------------


def parse_ds(ds: str | dt.date) -> dt.date:
    if isinstance(ds, dt.date):
        return ds
    try:
        return dt.date.fromisoformat(ds)
    except ValueError:
        raise ValueError(f"partition day {ds!r} is not a date in the form YYYY-MM-DD") from None


def ds_str(ds: str | dt.date) -> str:
    return parse_ds(ds).isoformat()


def day_range(start: str | dt.date, end: str | dt.date) -> list[str]:
    """Days from ``start`` to ``end``, both included, as YYYY-MM-DD strings."""
    first, last = parse_ds(start), parse_ds(end)
    return [(first + dt.timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def shift_ds(ds: str | dt.date, days: int) -> str:
    return (parse_ds(ds) + dt.timedelta(days=days)).isoformat()


# --- locations ----------------------------------------------------------------------------------------------


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
    that is a file, or that cannot be created or written; an object store without credentials, whose bucket is
    missing, or that refuses access. Entry points call it first, so that a mistyped root is one line, not a
    traceback from deep inside a step."""
    from core.failures import ConfigError

    text = os.fspath(root)
    fix = "set storage_root in the platform configuration, PINFLOW_STORAGE_ROOT or --root"
    if not is_remote(text):
        path = local_path(text)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"storage root {text} is a file, not a folder: {fix} to a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"storage root {text} cannot be created ({e.strerror}): {fix} to a folder "
                              "this user can write") from None
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


def exists(location: Location) -> bool:
    if not is_remote(location):
        return local_path(location).exists()
    fs, key = filesystem(location)
    return bool(fs.exists(key))


def is_dir(location: Location) -> bool:
    """A local folder, or a prefix holding at least one object."""
    if not is_remote(location):
        return local_path(location).is_dir()
    fs, key = filesystem(location)
    return bool(fs.isdir(key))


def read_bytes(location: Location) -> bytes:
    """The bytes of a file; FileNotFoundError if it is not there."""
    if not is_remote(location):
        return local_path(location).read_bytes()
    fs, key = filesystem(location)
    return bytes(fs.cat_file(key))


def read_text(location: Location) -> str:
    return read_bytes(location).decode()


def read_json(location: Location) -> Any:
    return json.loads(read_bytes(location))


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
    if not is_remote(base):
        return sorted(globlib.glob(os.path.join(globlib.escape(str(local_path(base))), pattern)))
    fs, key = filesystem(base)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(f"{globlib.escape(key.rstrip('/'))}/{pattern}"))


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
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES):
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


# --- the one publishing rule ----------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc < 2.28, or another libc
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the filesystem or kernel cannot exchange
        return False
    raise OSError(code, os.strerror(code), str(b))


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on the file ``lock``, created for the purpose and removed when
    released, so nothing stays behind. The holder removes it while it still holds it; a waiter that then gets
    the lock on the removed file sees that the path is no longer its file and starts over on the new one. Where
    there is no ``fcntl`` (Windows), nothing is locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                current = os.stat(lock)
            except FileNotFoundError:
                current = None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the previous holder removed this file: take the lock on the one at the path now
    try:
        yield
    finally:
        try:
            os.unlink(lock)
        finally:
            os.close(fd)  # releases the lock


@contextmanager
def publish(final: Location, marker: str | None = MARKER) -> Iterator[str]:
    """Yield a folder to fill; on success it replaces ``final`` whole, with ``marker`` written last.

    Local: a hidden temporary sibling, filled without a lock; then, holding the folder's lock file
    ``.<name>.lock`` beside it (so that concurrent writers of one folder take turns and the last one wins; the
    file is removed with the lock), the
    sibling is exchanged with the old folder in one atomic step (Linux ``renameat2``; elsewhere a rename pair,
    during which the folder is briefly missing) and the old contents are removed. A failure removes the
    temporary folder and leaves the old one. Object store (no rename): a new version folder
    ``final/_v=<version>/`` (see :func:`_publish_version`), which the marker, one PUT written last, names; the
    old version stays readable until then. ``marker=None`` for folders that have none (reports): on an object
    store their old objects are deleted first, then the new ones are written in place.
    """
    if is_remote(final):
        if marker:
            with _publish_version(os.fspath(final), marker) as folder:
                yield folder
            return
        remove_tree(final)
        yield os.fspath(final)
        return
    path = local_path(final)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield str(tmp)
        if marker:
            (tmp / marker).write_text(dt.datetime.now(dt.UTC).isoformat())
        with _locked(path.parent / f".{path.name}.lock"):
            if not path.exists():
                tmp.rename(path)
            elif not _exchange(tmp, path):
                old = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
                path.rename(old)
                tmp.rename(path)
                old.rename(tmp)
        # tmp now holds the old folder (if there was one); the except clause below also removes it on a failure.
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- versions of a folder on an object store ------------------------------------------------------------

VERSION_PREFIX = "_v="  # a name starting with "_": readers that list a folder (pyarrow, glob "*.parquet") skip it

# A version older than the one a publish replaced is removed only if that one had been published for this long: a
# reader that resolved an old version has at least this long to read it, however often the folder is republished
# (versions left meanwhile go with the first publish after the grace).
SUPERSEDED_GRACE_SECONDS = 900.0


def new_version() -> str:
    """A version id that sorts by time: ``YYYYmmddTHHMMSSffffffZ-<8 hex>``."""
    return f"{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{uuid.uuid4().hex[:8]}"


def marker_version(text: str | bytes) -> str | None:
    """The version a marker's content names (``{"version": ...}``, a versioned publish on an object store);
    None for a plain marker (a timestamp, or anything else an upstream producer or older code wrote)."""
    try:
        payload = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return None
    version = payload.get("version") if isinstance(payload, dict) else None
    if not isinstance(version, str) or not version or "/" in version:
        return None
    return version


def _marker_state(folder: str, marker: str = MARKER) -> tuple[bool, str | None]:
    """(whether ``folder`` has its marker, the version the marker names or None) of a folder on an object store."""
    fs, key = filesystem(folder)
    try:
        text = bytes(fs.cat_file(f"{key.rstrip('/')}/{marker}"))
    except FileNotFoundError:
        return False, None
    return True, marker_version(text)


def _version_folder(folder: str, version: str) -> str:
    return join(folder, f"{VERSION_PREFIX}{version}")


def resolve(folder: Location, marker: str = MARKER) -> str:
    """The folder that holds the files of the published version of ``folder``: on an object store, the version
    folder ``_v=<version>/`` its marker names; the folder itself on a local root, for a plain marker (written by an
    upstream producer or older code) and when there is no marker."""
    if not is_remote(folder):
        return os.fspath(folder)
    _, version = _marker_state(os.fspath(folder), marker)
    return _version_folder(os.fspath(folder), version) if version else os.fspath(folder)


def read_version(folder: Location, read: Callable[[str], _T], marker: str = MARKER) -> _T:
    """``read(resolve(folder))``; on an object store read again from the new version when the one it was reading was
    removed meanwhile (a FileNotFoundError while a later publish has replaced it twice)."""
    for attempt in range(_PIN_ATTEMPTS):
        where = resolve(folder, marker)
        try:
            return read(where)
        except FileNotFoundError:
            if attempt == _PIN_ATTEMPTS - 1 or where == os.fspath(folder) or resolve(folder, marker) == where:
                raise
    raise AssertionError("unreachable")


def _version_names(folder: str) -> tuple[list[str], list[str]]:
    """(the versions under a folder on an object store, sorted; the names of its other entries but the marker)."""
    fs, key = filesystem(folder)
    try:
        names = [name_of(entry) for entry in fs.ls(key, detail=False, refresh=True)]
    except FileNotFoundError:
        return [], []
    versions = sorted(n.removeprefix(VERSION_PREFIX) for n in names if n.startswith(VERSION_PREFIX))
    return versions, [n for n in names if not n.startswith(VERSION_PREFIX)]


# The marker of a store without conditional writes (not S3): written unconditionally.
_UNCONDITIONAL = "<unconditional>"


def _marker_tag(path: str) -> tuple[str | None, float | None]:
    """(the ETag of the marker object at ``path``, for a conditional switch: None if there is none, and
    ``_UNCONDITIONAL`` on stores other than S3; when the store says it was written, Unix seconds, or None)."""
    fs, key = filesystem(path)
    if "s3" not in fs.protocol:
        try:
            written = fs.modified(key)
        except (FileNotFoundError, NotImplementedError):
            written = None
        return _UNCONDITIONAL, written.timestamp() if written is not None else None
    bucket, name, _ = fs.split_path(key)
    try:
        head = fs.call_s3("head_object", Bucket=bucket, Key=name)
    except FileNotFoundError:
        return None, None
    return str(head["ETag"]), head["LastModified"].timestamp()


def _put_marker(path: str, text: str, tag: str | None) -> bool:
    """Write the marker at ``path`` if it is still the object ``tag`` names (None: if there is still none): an S3
    conditional PUT. False when another writer changed it since it was read; other stores: write, True."""
    if tag == _UNCONDITIONAL:
        write_text(path, text)
        return True
    fs, key = filesystem(path)
    bucket, name, _ = fs.split_path(key)
    condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=name, Body=text.encode(), **condition)
    except OSError as err:
        code = (getattr(err.__cause__, "response", None) or {}).get("Error", {}).get("Code")
        if isinstance(err, FileExistsError) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise
    finally:
        fs.invalidate_cache(key)
    return True


@contextmanager
def _publish_version(final: str, marker: str) -> Iterator[str]:
    """Publish a new version of ``final`` on an object store, which has no rename.

    The caller fills the fresh folder ``final/_v=<version>/`` (:func:`new_version`: ids sort by time); that folder
    gets its own copy of the marker (it is a complete partition by itself, what a pin of it reads), then ``final``'s
    marker, one PUT that S3 makes visible whole, switches readers to it (JSON: ``published``, ``version``). Readers
    (:func:`resolve`) see the old version or the new one, never none and never a mix. A failure before the switch
    removes the new folder and leaves the old version as it was.

    Concurrent writers: the switch is a compare-and-swap (the marker's ETag read, then a conditional PUT that S3
    refuses if the marker changed meanwhile; read again and decide again), so the marker only moves to newer
    versions: a writer that finds a newer version published steps aside (its folder is removed, as if it had
    published and been replaced at once). Afterwards the complete versions between the one replaced and its own are
    removed (the marker moved past them: never published); those older than the one replaced only if that one had
    been published for ``SUPERSEDED_GRACE_SECONDS`` (so a reader that resolved an old version has that long to read
    it, however fast the folder is republished); never the one replaced (kept for readers that resolved it just
    before the switch), one still being written (another writer's, which steps aside on seeing a newer one) or one
    newer than its own. Objects directly in ``final`` (a
    partition landed with a plain marker) are treated as the version before the first ``_v=`` one. (A store
    without conditional writes, not S3, writes the marker unconditionally.)
    """
    import logging

    version = new_version()
    folder = _version_folder(final, version)
    stamp = json.dumps({"published": dt.datetime.now(dt.UTC).isoformat(), "version": version}, sort_keys=True)
    path = join(final, marker)
    try:
        yield folder
        write_text(join(folder, marker), stamp)  # the version folder is complete
    except BaseException:
        remove_tree(folder)
        raise
    while True:
        try:
            # Before reading the content: a change in between fails the conditional PUT (so when the switch goes
            # through, ``since`` is when the version it replaces was published).
            tag, since = _marker_tag(path)
            _, replaced = _marker_state(final, marker)
        except BaseException:
            remove_tree(folder)
            raise
        if replaced == version:  # an earlier PUT of ours went through (its answer was lost and it was retried)
            break
        if replaced is not None and replaced > version:  # a newer version was published meanwhile: it stays
            remove_tree(folder)
            logging.getLogger(__name__).info(
                "%s: version %s was published while %s was written; it stays, %s is dropped",
                final, replaced, version, version)
            return
        # The switch (a failed PUT leaves the folder to a later publish: its answer may have been lost).
        if _put_marker(path, stamp, tag):
            break
        logging.getLogger(__name__).info("%s: the marker changed while %s was switching to: reading it again",
                                         final, version)
    try:
        _tidy(final, marker, version, replaced, since)
    except Exception as err:  # published: what is left over goes with a later publish
        logging.getLogger(__name__).warning("%s: version %s is published, but removing older versions failed: %s",
                                            final, version, err)


def _tidy(final: str, marker: str, version: str, replaced: str | None, since: float | None) -> None:
    """Remove the versions of ``final`` that readers no longer need now that ``version`` replaced ``replaced`` (None:
    a plain marker or none, whose objects are then kept), published at ``since`` (None: not known); see
    :func:`_publish_version`."""
    _, current = _marker_state(final, marker)
    if current != version:
        return  # a later publish switched since: its own tidy-up applies
    # The versions older than the replaced one stopped being published before it was: nobody resolved them in the
    # time it was published. Both times from the store's clock (asked only when there is a replaced version).
    expired = False
    if replaced is not None and since is not None:
        now = _marker_tag(join(final, marker))[1]
        expired = now is not None and now - since >= SUPERSEDED_GRACE_SECONDS
    versions, others = _version_names(final)
    for old in versions:
        if old >= version or old == replaced:  # newer: another writer's, which switches next; replaced: kept for
            continue                           # the readers that resolved it just before the switch
        if replaced is not None and old < replaced:
            if expired:
                remove_tree(_version_folder(final, old))
        # Between the two and complete: another writer's, which will never be switched to (the marker moved past
        # it); incomplete: still being written, its writer steps aside on seeing this version and removes it.
        elif exists(join(_version_folder(final, old), marker)):
            remove_tree(_version_folder(final, old))
    if replaced is not None and expired:  # the objects of a plain version older than the one replaced
        for name in others:
            if name != marker:
                path = join(final, name)
                if is_dir(path):
                    remove_tree(path)
                else:
                    remove(path)


# --- partitions ---------------------------------------------------------------------------------------------


def partition(root: Location, dataset: str, ds: str | dt.date) -> str:
    """The folder of one day of a dataset: ``<root>/<dataset>/ds=YYYY-MM-DD``."""
    return join(root, *dataset.split("/"), f"ds={ds_str(ds)}")


def is_complete(root: Location, dataset: str, ds: str | dt.date) -> bool:
    pin = pinned(root, dataset, ds)
    return exists(join(pin.location if pin else partition(root, dataset, ds), MARKER))


def complete_days(root: Location, dataset: str) -> list[str]:
    """The days of ``dataset`` whose partition is complete (has its marker), sorted (a dataset ``root`` pins, an
    :class:`InputPins`: its pinned days)."""
    days = root.days(dataset) if isinstance(root, InputPins) else None
    if days is not None:
        return days
    markers = glob(join(root, *dataset.split("/")), f"ds=*/{MARKER}")
    return sorted(marker.replace(os.sep, "/").rsplit("/", 2)[-2].removeprefix("ds=") for marker in markers)


def partition_folder(root: Location, dataset: str, ds: str | dt.date) -> str:
    """The folder that holds the files of the partition's published version (:func:`resolve`; a partition this
    pinned: its pin's location, :class:`InputPins`). No check that the partition is complete."""
    pin = pinned(root, dataset, ds)
    return pin.location if pin is not None else resolve(partition(root, dataset, ds))


def data_files(root: Location, dataset: str, ds: str | dt.date) -> list[str]:
    """The Parquet files of a complete partition; FileNotFoundError naming the partition if it is incomplete.

    On an object store, those of the version folder its marker names (:func:`resolve`). A partition pinned in
    ``root`` (:class:`InputPins`): the files of the pinned version (a DataError if it is gone, or if an object store's
    unversioned partition holds another one now).
    """
    pin = pinned(root, dataset, ds)
    if pin is not None:
        return _pinned_files(pin)
    return _data_files(root, dataset, ds)[1]


def _data_files(root: Location, dataset: str, ds: str | dt.date) -> tuple[str | None, list[str]]:
    """(the version read, None if unversioned; the Parquet files of the complete partition)."""
    path = partition(root, dataset, ds)
    missing = f"{dataset} partition ds={ds_str(ds)} is missing or incomplete: no {MARKER} marker in {path}"
    if not is_remote(path):
        if not exists(join(path, MARKER)):
            raise FileNotFoundError(missing)
        return None, glob(path, "*.parquet")
    for _ in range(_PIN_ATTEMPTS):
        complete, version = _marker_state(path)
        if not complete:
            raise FileNotFoundError(missing)
        if version is None:
            return None, glob(path, "*.parquet")
        files = glob(_version_folder(path, version), "*.parquet")
        if files or _marker_state(path)[1] == version:  # none: removed by later publishes meanwhile, or empty
            return version, files
    raise OSError(f"{dataset} partition ds={ds_str(ds)} was republished {_PIN_ATTEMPTS} times while it was listed")


@contextmanager
def write_partition(root: Location, dataset: str, ds: str | dt.date) -> Iterator[str]:
    """Yield a folder to fill with the partition's files; on success it becomes the partition (see :func:`publish`)."""
    with publish(partition(root, dataset, ds)) as staging:
        yield staging


def write_table(
    root: Location, dataset: str, ds: str | dt.date, table: pa.Table, metadata: dict[str, Any] | None = None
) -> str:
    """Write one table as a complete partition, with optional JSON metadata beside it (``_metadata.json``)."""
    import pyarrow.parquet as pq

    with write_partition(root, dataset, ds) as staging:
        with open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(table, f, row_group_size=64 * 1024)
        if metadata is not None:
            write_json(join(staging, METADATA_FILE), metadata)
    return partition(root, dataset, ds)


def read_parquet(location: Location, columns: list[str] | None = None) -> pa.Table:
    import pyarrow.parquet as pq

    if not is_remote(location):
        return pq.read_table(str(local_path(location)), columns=columns)
    fs, key = filesystem(location)
    return pq.read_table(key, columns=columns, filesystem=fs)


def read_table(root: Location, dataset: str, ds: str | dt.date, columns: list[str] | None = None) -> pa.Table:
    import pyarrow as pa

    pin = pinned(root, dataset, ds)
    if pin is None and not is_remote(root):
        return _read_local_partition(local_path(partition(root, dataset, ds)), dataset, ds, columns)
    for attempt in range(_PIN_ATTEMPTS):
        version, files = (None, _pinned_files(pin)) if pin is not None else _data_files(root, dataset, ds)
        if not files:
            raise FileNotFoundError(f"{dataset} partition ds={ds_str(ds)} has a marker but no Parquet file")
        try:
            table = pa.concat_tables([read_parquet(f, columns=columns) for f in files])
        except FileNotFoundError:
            if pin is not None:
                check_pin(pin)  # a DataError naming the partition when its pinned version went
            # On an object store, a version removed while it was read (after the grace): read the new one.
            if version is None or attempt == _PIN_ATTEMPTS - 1 or _marker_state(partition(root, dataset, ds))[1] == version:
                raise
            continue
        if pin is not None:
            check_pin(pin)  # on an object store: still the pinned version after the read (checked before it too)
        return table
    raise AssertionError("unreachable")


def _in_place(fd: int, path: Path) -> bool:
    """Whether the folder open as ``fd`` is still the one at ``path``: a local publish exchanges a folder whole and
    deletes the old one, never puts it back, so a folder that is still in place was in place all along."""
    held = os.fstat(fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _read_local_partition(path: Path, dataset: str, ds: str | dt.date, columns: list[str] | None) -> pa.Table:
    """The Parquet files of a complete local partition, every one from the same published version: the folder is
    opened once and its files are opened through that handle, so a publish that exchanges the folder meanwhile
    (and deletes the old one, whose open files stay readable) never mixes two versions or loses a file."""
    import fnmatch

    import pyarrow as pa
    import pyarrow.parquet as pq

    what = f"{dataset} partition ds={ds_str(ds)}"
    for _ in range(_PIN_ATTEMPTS):
        try:
            folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {path}") from None
        opened: list[IO[bytes]] = []
        try:
            names = sorted(os.listdir(folder))
            try:
                if MARKER not in names:
                    raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {path}")
                for name in names:
                    if fnmatch.fnmatch(name, "*.parquet") and not name.startswith("."):
                        opened.append(os.fdopen(os.open(name, os.O_RDONLY, dir_fd=folder), "rb"))
                if not opened:
                    raise FileNotFoundError(f"{what} has a marker but no Parquet file")
            except FileNotFoundError:
                if _in_place(folder, path):
                    raise
                continue  # the folder listed was replaced and is being deleted: open the new one
            if _in_place(folder, path):  # every file opened is of the version in place
                return pa.concat_tables([pq.read_table(f, columns=columns) for f in opened])
        finally:
            for f in opened:
                f.close()
            os.close(folder)
    raise OSError(f"{what} was republished {_PIN_ATTEMPTS} times while it was opened: read it again later")


def read_metadata(root: Location, dataset: str, ds: str | dt.date) -> dict[str, Any]:
    """The partition's ``_metadata.json``; {} if it has none (of the published version on an object store, of the
    pinned version if ``root`` pins it)."""
    pin = pinned(root, dataset, ds)
    try:
        if pin is not None:
            meta = dict(read_json(join(pin.location, METADATA_FILE)))
        else:
            meta = dict(read_version(partition(root, dataset, ds), lambda where: read_json(join(where, METADATA_FILE))))
    except FileNotFoundError:
        meta = {}
    if pin is not None:  # one object read: a check after it sees any replacement before or during it
        check_pin(pin)
    return meta


@contextmanager
def parquet_file(location: Location, pins: InputPins | None = None) -> Iterator[pq.ParquetFile]:
    """An open ``pyarrow.parquet.ParquetFile``: its footer is read now, row groups only when asked for.

    On an object store every read is one ranged GET of what the Parquet reader asks for (no read-ahead),
    so reading one row group of a large file downloads that row group and the footer, not the file. A file of a
    version pinned in ``pins`` must still be that version (else a DataError).
    """
    import pyarrow.parquet as pq

    if not is_remote(location):
        with pq.ParquetFile(str(local_path(location))) as parquet:
            yield parquet
        return
    fs, key = filesystem(location)
    entry = pins.pinned_object(location) if pins is not None else None
    if entry is None:
        with fs.open(key, "rb", cache_type="none") as f, pq.ParquetFile(f) as parquet:
            yield parquet
        return
    # A pinned file: the object must be the pinned one when opened, and s3fs reads every range with If-Match on
    # the ETag it opened, so a replacement afterwards fails the read instead of mixing two versions.
    from core.failures import DataError

    pin, name = entry
    try:
        with fs.open(key, "rb", cache_type="none") as f:
            etag = getattr(f, "details", {}).get("ETag")
            if etag != pin.files[name].get("etag"):
                raise DataError(_rebuilt(pin, f"its {name} has ETag {etag} instead of {pin.files[name].get('etag')}"))
            with pq.ParquetFile(f) as parquet:
                yield parquet
    except (FileNotFoundError, OSError) as err:
        if isinstance(err, FileNotFoundError) or type(err).__name__ == "FileExpired":
            raise DataError(_rebuilt(pin, f"its {name} was replaced while it was read ({err})")) from None
        raise


# --- snapshots (raw/pins, raw/users) --------------------------------------------------------------------


def snapshot_days(root: Location, dataset: str, ds: str | dt.date) -> list[str]:
    """The partitions that make the view of a snapshot dataset as of ``ds``, oldest first.

    A snapshot partition is full unless its ``_metadata.json`` says ``"snapshot": "incremental"`` (only the rows
    that changed or appeared that day). The view as of ``ds`` is the newest full partition on or before ``ds``
    and every incremental one after it; [] when there is none.
    """
    days = [d for d in complete_days(root, dataset) if d <= ds_str(ds)]
    chosen: list[str] = []
    for day in reversed(days):  # back to the newest full one (only increments: all of them are the view)
        chosen.append(day)
        if read_metadata(root, dataset, day).get("snapshot", "full") != "incremental":
            break
    return list(reversed(chosen))


def read_snapshot(
    root: Location, dataset: str, ds: str | dt.date, key: str, columns: list[str] | None = None
) -> tuple[pa.Table, str | None]:
    """The view of a snapshot dataset as of ``ds`` (see :func:`snapshot_days`): one row per ``key``, the newest
    partition's row winning; and the newest partition's day (None and an empty table when there is none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    days = snapshot_days(root, dataset, ds)
    if not days:
        return pa.table({}), None
    wanted = None if columns is None else list(dict.fromkeys([key, *columns]))
    tables = [read_table(root, dataset, day, columns=wanted) for day in days]
    if len(tables) == 1:
        return tables[0], days[-1]
    order = pa.concat_tables([t.append_column("_rank", pa.array([i] * t.num_rows, pa.int32()))
                              for i, t in enumerate(tables)], promote_options="permissive")
    # The newest row per key: sort by key, then by partition (newest last), keep each key's last row.
    order = order.sort_by([(key, "ascending"), ("_rank", "ascending")])
    keys = order.column(key)
    last = pc.not_equal(keys.slice(0, len(keys) - 1), keys.slice(1)) if len(keys) > 1 else pa.array([], pa.bool_())
    keep = pa.concat_arrays([last.combine_chunks() if isinstance(last, pa.ChunkedArray) else last, pa.array([True])])
    return order.filter(keep).drop_columns(["_rank"]), days[-1]


# --- pinned inputs: a run's frozen view of the partitions it reads ----------------------------------------

PINS_FILE = "PINS.json"
_PIN_ATTEMPTS = 5


@dataclass(frozen=True)
class Pin:
    """One input partition as a run pinned it: the version it reads, wherever it reads it.

    ``version`` identifies what was published (a digest of the marker's content, its publish time, and the
    files' names, sizes and, on an object store, ETags). ``location`` is where readers read it: on a local root a
    folder of hard links to the files of that version (``source`` is the live partition), which stays as it is
    whatever is published at ``source`` later, because published files are never modified in place; on an object
    store, the version folder ``<source>/_v=<version>/`` of a versioned partition (:func:`publish`), never changed
    once published, and readable until a later publish removes it (then a read is a DataError naming the
    partition); for a partition landed with a plain marker, the partition itself (``location == source``),
    checked against ``files`` and ``marker`` when it is read.
    """

    dataset: str
    ds: str
    version: str
    location: str
    source: str
    marker: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"size": int, "etag": str | None}

    @property
    def frozen(self) -> bool:
        """Whether ``location`` holds the pinned version only (True: a local copy, or an object store's version
        folder), or is the live partition, checked on read (False)."""
        return self.location != self.source

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "location": self.location, "source": self.source, "marker": self.marker,
                "files": {name: dict(info) for name, info in self.files.items()}}

    @classmethod
    def from_dict(cls, dataset: str, ds: str, data: dict[str, Any]) -> Pin:
        """A pin from its entry in a pin manifest (RUN.json ``inputs``); ValueError naming what is wrong."""
        missing = [k for k in ("version", "location", "source", "marker", "files") if k not in data]
        if missing:
            raise ValueError(f"pinned input {dataset} ds={ds} lacks {', '.join(missing)}")
        return cls(dataset, ds_str(ds), str(data["version"]), str(data["location"]), str(data["source"]),
                   str(data["marker"]), {str(k): dict(v) for k, v in dict(data["files"]).items()})


def _version(marker: str, files: dict[str, dict[str, Any]]) -> str:
    payload = json.dumps({"marker": marker, "files": files}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class _Replaced(Exception):
    """The folder being pinned was replaced by a publish while its files were linked: pin it again."""


def _link_or_copy(dir_fd: int, name: str, target: Path) -> None:
    """A hard link of ``name`` (in the open folder ``dir_fd``) at ``target``; a copy where links fail (another
    filesystem). _Replaced if the file is gone (the folder was replaced and is being removed)."""
    try:
        os.link(name, target, src_dir_fd=dir_fd, follow_symlinks=False)
        return
    except FileNotFoundError:
        raise _Replaced from None
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES):
            raise
    try:
        source = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _Replaced from None
    with os.fdopen(source, "rb") as fin, target.open("wb") as fout:
        shutil.copyfileobj(fin, fout, 8 << 20)


def _pin_local(source: Path, target: Path, what: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """Hard-link the files of one published version of the folder ``source`` into ``target``; (marker, files).

    The folder is opened once and its files are linked through that handle, so they all come from one version. That
    version is taken only if the folder is still the one at ``source`` once every file is linked: a published folder
    is never changed while it is in place, whereas one that a publish exchanged meanwhile is being deleted (some of
    its files may be gone already), so the pin starts over on the new version.
    """

    for _ in range(_PIN_ATTEMPTS):
        shutil.rmtree(target, ignore_errors=True)
        try:
            fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{what} is missing: no folder {source}") from None
        try:
            names = sorted(n for n in os.listdir(fd) if not n.startswith("."))
            if MARKER not in names:
                if not _in_place(fd, source):
                    continue
                raise FileNotFoundError(f"{what} is incomplete: no {MARKER} marker in {source}")
            target.mkdir(parents=True)
            files = {}
            for name in names:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    continue  # readers read the files directly in the partition only
                _link_or_copy(fd, name, target / name)
                files[name] = {"size": info.st_size, "etag": None}
            if _in_place(fd, source):
                return (target / MARKER).read_text(), files
        except (_Replaced, FileNotFoundError) as err:  # a file of a replaced version deleted under us
            if _in_place(fd, source):
                if isinstance(err, _Replaced):
                    raise FileNotFoundError(f"{what}: a file vanished from {source} while it was pinned") from None
                raise
        finally:
            os.close(fd)
    shutil.rmtree(target, ignore_errors=True)
    raise OSError(f"{what} was republished {_PIN_ATTEMPTS} times while it was being pinned: pin it again later")


def _remote_files(folder: str) -> dict[str, dict[str, Any]]:
    """The files directly in a folder on an object store, with their sizes and ETags ({} if there are none)."""
    fs, key = filesystem(folder)
    try:
        entries = fs.ls(key, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {name_of(e["name"]): {"size": int(e.get("size") or 0), "etag": e.get("ETag") or e.get("etag")}
            for e in entries if e.get("type") == "file" and not name_of(e["name"]).startswith(".")}


def _remote_state(folder: str, what: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """(marker content, files with sizes and ETags) of a published folder on an object store, read consistently
    (the listing is read again after the marker; a publish in between is retried)."""
    fs, key = filesystem(folder)
    for _ in range(_PIN_ATTEMPTS):
        files = _remote_files(folder)
        if MARKER not in files:
            raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {folder}")
        try:
            marker = bytes(fs.cat_file(f"{key.rstrip('/')}/{MARKER}")).decode()
        except FileNotFoundError:
            continue
        if _remote_files(folder) == files:
            return marker, files
    raise OSError(f"{what} was republished {_PIN_ATTEMPTS} times while it was being pinned: pin it again later")


def pin_partition(root: Location, dataset: str, ds: str | dt.date, pins_root: Location) -> Pin:
    """Pin the version of one complete partition that is published now (see :class:`Pin`).

    Local: its files are hard-linked (copied where links fail) into ``<pins_root>/<dataset>/ds=<day>/``, the
    layout of a storage root; an object store: its version is recorded, nothing copied (the location is the
    version folder its marker names, or the partition itself for a plain marker). FileNotFoundError naming
    the partition when it is missing or incomplete.
    """
    day = ds_str(ds)
    source = partition(root, dataset, day)
    what = f"{dataset} partition ds={day}"
    if is_remote(root):
        for _ in range(_PIN_ATTEMPTS):
            complete, version = _marker_state(source)
            if not complete:
                raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {source}")
            location = _version_folder(source, version) if version else source
            try:
                marker, files = _remote_state(location, what)
            except FileNotFoundError:
                if version is None or _marker_state(source)[1] == version:
                    raise
                continue  # the version was removed by later publishes meanwhile: pin the current one
            return Pin(dataset, day, _version(marker, files), location, source, marker, files)
        raise OSError(f"{what} was republished {_PIN_ATTEMPTS} times while it was being pinned: pin it again later")
    target = partition(pins_root, dataset, day)
    marker, files = _pin_local(local_path(source), local_path(target), what)
    return Pin(dataset, day, _version(marker, files), target, source, marker, files)


def pins_intact(inputs: dict[str, dict[str, dict[str, Any]]]) -> bool:
    """Whether every frozen local copy of a pin manifest (``dataset -> day -> Pin.to_dict()``) is still complete
    (an object store's version folder that is gone is the run's DataError when read, as a changed partition)."""
    for dataset, days in inputs.items():
        for ds, entry in days.items():
            pin = Pin.from_dict(dataset, ds, entry)
            if pin.frozen and not is_remote(pin.location) and not all(exists(join(pin.location, name)) for name in pin.files):
                return False
    return True


def check_pin(pin: Pin) -> None:
    """DataError unless an object store still holds the pinned version: the version folder of a versioned
    partition still holds the pinned files, an unversioned partition still the pinned marker and files."""
    if not is_remote(pin.location):
        return
    from core.failures import DataError

    what = f"{pin.dataset} partition ds={pin.ds}"
    if pin.frozen:  # a version folder: never changed, but removed by the publishes after the one that replaced it
        if _remote_files(pin.location) != pin.files:
            raise DataError(_rebuilt(pin, f"its version folder was removed by later publishes (a publish keeps the "
                                          f"version it replaced, older ones for {SUPERSEDED_GRACE_SECONDS:.0f} s after"
                                          f" they were replaced); the partition now holds {resolve(pin.source)}"))
        return
    try:
        marker, files = _remote_state(pin.location, what)
    except (FileNotFoundError, OSError) as err:
        raise DataError(_rebuilt(pin, f"it is being rebuilt or was removed ({err})")) from None
    if marker != pin.marker or files != pin.files:
        raise DataError(_rebuilt(pin, f"it now holds version {_version(marker, files)}"))


def _rebuilt(pin: Pin, now: str) -> str:
    kept = ("An object store keeps a replaced version only until the publishes after it" if pin.frozen else
            "An object store keeps no copy of a pinned version")
    return (
        f"{pin.dataset} partition ds={pin.ds} ({pin.location}) changed during this run: the run pinned version "
        f"{pin.version} when it was planned and {now}. {kept}, so the run "
        "stops rather than mix versions: start a new run of the training (the tries of one run share its pins, "
        f"in {PINS_FILE} beside its checkpoints)"
    )


@dataclass(frozen=True)
class InputPins:
    """A storage root as a training run reads it: the root, and the partitions the run pinned there.

    Readers honour the pins only when they are given this value where they take a root (it is a path-like of the
    root): :func:`is_complete`, :func:`data_files`, :func:`partition_folder`, :func:`read_metadata`,
    :func:`read_table` and :func:`read_snapshot` resolve a pinned day to its pin's location (on an object store
    they check its version, a DataError when it changed), :func:`complete_days` of a pinned dataset lists its
    pinned days only (the view the run was planned on, e.g. of a snapshot dataset), and :func:`parquet_file`
    checks a pinned object given ``pins``. Given the plain root, they read the live partitions. Writers are not
    affected. Build it with :meth:`of`.
    """

    root: str
    pins: dict[tuple[str, str], Pin] = field(default_factory=dict)  # (dataset, day) -> its pin

    @classmethod
    def of(cls, root: Location, inputs: dict[str, dict[str, dict[str, Any]]]) -> InputPins:
        """The view of ``root`` with the pins of a manifest (``dataset -> day -> Pin.to_dict()``, RUN.json
        ``inputs``; ValueError naming a bad entry). A pin of a partition under another root (a RUN.json copied to
        another root) does not describe this root's partitions: it is left out, with a warning, and read live."""
        pins = {}
        for dataset, days in inputs.items():
            for ds, entry in days.items():
                pin = Pin.from_dict(dataset, ds, entry)
                if _root_key(pin.source) != _root_key(partition(root, dataset, pin.ds)):
                    import logging

                    logging.getLogger(__name__).warning(
                        "pinned input %s ds=%s comes from %s, not from root %s: its live partition is read",
                        dataset, pin.ds, pin.source, root)
                    continue
                pins[dataset, pin.ds] = pin
        return cls(os.fspath(root), pins)

    def __fspath__(self) -> str:
        return self.root

    def __str__(self) -> str:
        return self.root

    def pin(self, dataset: str, ds: str | dt.date) -> Pin | None:
        return self.pins.get((dataset, ds_str(ds)))

    def days(self, dataset: str) -> list[str] | None:
        """The pinned days of ``dataset``, None if none is pinned."""
        return sorted(day for name, day in self.pins if name == dataset) or None

    def pinned_object(self, location: Location) -> tuple[Pin, str] | None:
        """(its pin, its name) for a file of a pinned version on an object store."""
        url = os.fspath(location)
        for pin in self.pins.values():
            if is_remote(pin.location) and url.startswith(pin.location.rstrip("/") + "/"):
                name = url[len(pin.location.rstrip("/")) + 1:]
                if name in pin.files:
                    return pin, name
        return None


def _root_key(root: Location) -> str:
    return os.fspath(root).rstrip("/") if is_remote(root) else os.path.realpath(local_path(root))


def pins_of(root: Location) -> InputPins | None:
    """The pins a reader honours: those of ``root`` if it is an :class:`InputPins`."""
    return root if isinstance(root, InputPins) else None


def pinned(root: Location, dataset: str, ds: str | dt.date) -> Pin | None:
    """The pin a reader given ``root`` reads a partition at, None if it is not pinned."""
    return root.pin(dataset, ds) if isinstance(root, InputPins) else None


def _pinned_files(pin: Pin) -> list[str]:
    if pin.frozen and not is_remote(pin.location):
        if not exists(join(pin.location, MARKER)):
            raise FileNotFoundError(
                f"the pinned copy of {pin.dataset} partition ds={pin.ds} is missing: no {MARKER} in {pin.location} "
                f"(removed by hand?); rerun the training task, which pins its inputs again"
            )
        return sorted(join(pin.location, name) for name in pin.files if name.endswith(".parquet"))
    check_pin(pin)
    return sorted(join(pin.location, name) for name in pin.files if name.endswith(".parquet"))
