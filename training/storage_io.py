"""Where a training job's files live: a local path, or an fsspec URL such as ``s3://bucket/prefix/...``.

Every file the compute nodes read or write goes through here: RUN.json, the storage root's partitions
(:func:`complete_days`, :func:`data_files`, :func:`parquet_file`), heartbeats, failure files,
``result.json``, ``mlflow_run.json`` and the checkpoints' markers. A path without a scheme (or a
``file://`` URL) stays on the local filesystem and keeps ``features.storage``'s write-then-rename;
anything else goes through fsspec (s3fs for ``s3://``). S3 credentials, region and endpoint come from
the usual AWS sources: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, the instance
or pod role, ``AWS_DEFAULT_REGION``, and ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an
S3-compatible server (botocore reads them; nothing is passed here).

An object store has no rename, but a small object is written with a single PUT, which S3 makes visible
whole or not at all: a reader never sees half a heartbeat there either. Listings are never served from
fsspec's cache, because the files are written by other processes and other nodes.
"""

from __future__ import annotations

import datetime as dt
import glob as globlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from features import storage

if TYPE_CHECKING:
    import pyarrow.parquet as pq
    from fsspec import AbstractFileSystem


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for a URL of another filesystem than the local one (``s3://...``); False for a path or file://."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(path).removeprefix("file://"))


def join(base: str | os.PathLike[str], *names: str) -> str:
    """``base/name/...`` for a local path or a URL (a URL keeps its scheme and ``/`` separators)."""
    if is_remote(base):
        return "/".join([os.fspath(base).rstrip("/"), *names])
    return str(local_path(base).joinpath(*names))


def filesystem(url: str | os.PathLike[str]) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of a URL and the path inside it, with its listing cache emptied."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.fspath(url))
    fs.invalidate_cache()  # another process or node may have written or deleted files since
    return fs, path


def exists(path: str | os.PathLike[str]) -> bool:
    if not is_remote(path):
        return local_path(path).exists()
    fs, key = filesystem(path)
    return bool(fs.exists(key))


def read_text(path: str | os.PathLike[str]) -> str:
    """The text of a file; FileNotFoundError if it is not there."""
    if not is_remote(path):
        return local_path(path).read_text()
    fs, key = filesystem(path)
    return bytes(fs.cat_file(key)).decode()


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one.

    Locally through a temporary sibling and a rename; on an object store as one PUT.
    """
    if not is_remote(path):
        storage.write_json_atomic(local_path(path), payload)
        return
    fs, key = filesystem(path)
    fs.pipe_file(key, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file; nothing happens if it is not there."""
    if not is_remote(path):
        local_path(path).unlink(missing_ok=True)
        return
    fs, key = filesystem(path)
    try:
        fs.rm_file(key)
    except FileNotFoundError:
        pass


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder (every object under the prefix) and all it holds; nothing happens if it is not there."""
    if not is_remote(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    fs, key = filesystem(path)
    if fs.exists(key):
        fs.rm(key, recursive=True)


def make_dirs(path: str | os.PathLike[str]) -> None:
    """Create a local folder and its parents; an object store has no folders to create."""
    if not is_remote(path):
        local_path(path).mkdir(parents=True, exist_ok=True)


def glob(base: str | os.PathLike[str], pattern: str) -> list[str]:
    """Paths (or URLs, with their scheme) under ``base`` matching ``pattern`` (``*/x.json``), sorted.

    Only ``pattern`` is a pattern: ``*``, ``?`` or ``[`` in ``base`` match themselves.
    """
    if not is_remote(base):
        return sorted(globlib.glob(os.path.join(globlib.escape(str(local_path(base))), pattern)))
    fs, key = filesystem(base)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(f"{globlib.escape(key.rstrip('/'))}/{pattern}"))


@contextmanager
def parquet_file(path: str | os.PathLike[str]) -> Iterator[pq.ParquetFile]:
    """An open ``pyarrow.parquet.ParquetFile``: its footer is read now, row groups only when asked for.

    On an object store every read is one ranged GET of what the Parquet reader asks for (no read-ahead),
    so reading one row group of a large file downloads that row group and the footer, not the file.
    """
    import pyarrow.parquet as pq

    if not is_remote(path):
        with pq.ParquetFile(str(local_path(path))) as parquet:
            yield parquet
        return
    fs, key = filesystem(path)
    with fs.open(key, "rb", cache_type="none") as f, pq.ParquetFile(f) as parquet:
        yield parquet


# --- partitions of the storage root (features.storage's layout, on a local root or a URL) ----------


def partition(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> str:
    return join(root, dataset, f"ds={storage.ds_str(ds)}")


def is_complete(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> bool:
    if not is_remote(root):
        return storage.is_complete(root, dataset, ds)
    return exists(join(partition(root, dataset, ds), storage.MARKER))


def complete_days(root: str | os.PathLike[str], dataset: str) -> list[str]:
    """The days of ``dataset`` whose partition is complete (has its marker), sorted."""
    if not is_remote(root):
        return storage.complete_days(root, dataset)
    markers = glob(join(root, dataset), f"ds=*/{storage.MARKER}")
    return sorted(marker.rsplit("/", 2)[-2].removeprefix("ds=") for marker in markers)


def data_files(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> list[str]:
    """The Parquet files of a complete partition; FileNotFoundError naming the partition if it is incomplete."""
    if not is_remote(root):
        return [str(p) for p in storage.data_files(root, dataset, ds)]
    path = partition(root, dataset, ds)
    if not exists(join(path, storage.MARKER)):
        raise FileNotFoundError(
            f"{dataset} partition ds={storage.ds_str(ds)} is missing or incomplete: no {storage.MARKER} marker in {path}"
        )
    return glob(path, "*.parquet")
