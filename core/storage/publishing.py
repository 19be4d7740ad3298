"""The one publishing rule (see the package's docstring): a folder is published whole with its marker written last,
on a local root by an atomic exchange, on an object store as a version folder its marker names; and how readers
find the published version (:func:`resolve`, :func:`read_version`).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import glob
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from core.storage.paths import (
    Location,
    exists,
    filesystem,
    is_dir,
    is_remote,
    join,
    last_modified,
    local_path,
    name_of,
    remove,
    remove_tree,
    write_text,
)

MARKER = "_SUCCESS"
# A writer's temporary folder untouched this long is a killed writer's leftover (the next publish beside it removes it).
STALE_TEMPORARY_S = 24 * 3600
# How often a reader (or a pin) starts over on a folder that was republished while it read it.
_ATTEMPTS = 5
_T = TypeVar("_T")


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
    _remove_stale_temporaries(path)
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


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary siblings of ``path`` (``.tmp-<name>-*``) that killed writers left, once untouched for
    ``STALE_TEMPORARY_S``: no writer of theirs still runs (a live one writes into its folder)."""
    cutoff = time.time() - STALE_TEMPORARY_S
    for tmp in path.parent.glob(f".tmp-{glob.escape(path.name)}-*"):
        try:
            written = last_modified(str(tmp))
        except OSError:  # another writer's, published or removed while it was looked at: not a leftover
            continue
        if written is not None and written < cutoff:
            shutil.rmtree(tmp, ignore_errors=True)


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
    for attempt in range(_ATTEMPTS):
        where = resolve(folder, marker)
        try:
            return read(where)
        except FileNotFoundError:
            if attempt == _ATTEMPTS - 1 or where == os.fspath(folder) or resolve(folder, marker) == where:
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


def _in_place(fd: int, path: Path) -> bool:
    """Whether the folder open as ``fd`` is still the one at ``path``: a local publish exchanges a folder whole and
    deletes the old one, never puts it back, so a folder that is still in place was in place all along."""
    held = os.fstat(fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
