"""The storage layout of DESIGN.md §2 and its atomic, idempotent partition writes.

A partition is the folder ``<root>/<dataset>/ds=YYYY-MM-DD/``. It exists for readers only once its
completion marker ``_SUCCESS`` is there. Writers fill a hidden temporary sibling and rename it into place,
so a crash never leaves partial output visible, and rerunning a day replaces exactly that day.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MARKER = "_SUCCESS"
DATA_FILE = "part-00000.parquet"


def local_root(root: str | os.PathLike[str]) -> Path:
    """The local path of a storage root given as a path or a ``file://`` URL."""
    text = os.fspath(root)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" in text:
        raise ValueError(
            f"storage root {text!r}: only local paths and file:// URLs are supported by this build; "
            "set PINFLOW_STORAGE_ROOT to a local folder"
        )
    return Path(text)


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


def partition_path(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> Path:
    return local_root(root) / dataset / f"ds={ds_str(ds)}"


def is_complete(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> bool:
    return (partition_path(root, dataset, ds) / MARKER).exists()


def complete_days(root: str | os.PathLike[str], dataset: str) -> list[str]:
    """The days of ``dataset`` whose partition is complete, sorted."""
    base = local_root(root) / dataset
    if not base.exists():
        return []
    days = [p.name[3:] for p in base.glob("ds=*") if (p / MARKER).exists()]
    return sorted(days)


def data_files(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> list[Path]:
    """The Parquet files of a complete partition; raises FileNotFoundError naming the partition if incomplete."""
    path = partition_path(root, dataset, ds)
    if not (path / MARKER).exists():
        raise FileNotFoundError(
            f"{dataset} partition ds={ds_str(ds)} is missing or incomplete: no {MARKER} marker in {path}"
        )
    return sorted(path.glob("*.parquet"))


@contextmanager
def write_partition(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it atomically replaces the partition, marker included."""
    final = partition_path(root, dataset, ds)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        (tmp / MARKER).write_text(dt.datetime.now(dt.UTC).isoformat())
        old = None
        if final.exists():
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_table(
    root: str | os.PathLike[str],
    dataset: str,
    ds: str | dt.date,
    table: pa.Table,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write one table as a complete partition, with optional JSON metadata beside it (``_metadata.json``)."""
    with write_partition(root, dataset, ds) as tmp:
        pq.write_table(table, tmp / DATA_FILE, row_group_size=64 * 1024)
        if metadata is not None:
            (tmp / "_metadata.json").write_text(json.dumps(metadata, indent=2, sort_keys=True))
    return partition_path(root, dataset, ds)


def read_table(
    root: str | os.PathLike[str], dataset: str, ds: str | dt.date, columns: list[str] | None = None
) -> pa.Table:
    files = data_files(root, dataset, ds)
    if not files:
        raise FileNotFoundError(f"{dataset} partition ds={ds_str(ds)} has a marker but no Parquet file")
    return pa.concat_tables([pq.read_table(f, columns=columns) for f in files])


def read_metadata(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> dict[str, Any]:
    path = partition_path(root, dataset, ds) / "_metadata.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` through a temporary sibling, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
