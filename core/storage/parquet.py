"""Parquet tables: a partition written from a table and read into one, its metadata, one file opened lazily, and
the view of a snapshot dataset."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from core.storage.days import ds_str, partition
from core.storage.partitions import DATA_FILE, METADATA_FILE, _data_files, complete_days, write_partition
from core.storage.paths import (
    Location,
    dispatch,
    filesystem,
    is_remote,
    join,
    local_path,
    open_output,
    read_json,
    write_json,
)
from core.storage.pins import InputPins, _pinned_files, _rebuilt, check_pin, pinned
from core.storage.publishing import _ATTEMPTS, MARKER, _in_place, _marker_state, read_version

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq


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

    return dispatch(location, lambda path: pq.read_table(str(path), columns=columns),
                    lambda fs, key: pq.read_table(key, columns=columns, filesystem=fs))


def read_table(root: Location, dataset: str, ds: str | dt.date, columns: list[str] | None = None) -> pa.Table:
    import pyarrow as pa

    pin = pinned(root, dataset, ds)
    if pin is None and not is_remote(root):
        return _read_local_partition(local_path(partition(root, dataset, ds)), dataset, ds, columns)
    for attempt in range(_ATTEMPTS):
        version, files = (None, _pinned_files(pin)) if pin is not None else _data_files(root, dataset, ds)
        if not files:
            raise FileNotFoundError(f"{dataset} partition ds={ds_str(ds)} has a marker but no Parquet file")
        try:
            table = pa.concat_tables([read_parquet(f, columns=columns) for f in files])
        except FileNotFoundError:
            if pin is not None:
                check_pin(pin)  # a DataError naming the partition when its pinned version went
            # On an object store, a version removed while it was read (after the grace): read the new one.
            if version is None or attempt == _ATTEMPTS - 1 or _marker_state(partition(root, dataset, ds))[1] == version:
                raise
            continue
        if pin is not None:
            check_pin(pin)  # on an object store: still the pinned version after the read (checked before it too)
        return table
    raise AssertionError("unreachable")


def _read_local_partition(path: Path, dataset: str, ds: str | dt.date, columns: list[str] | None) -> pa.Table:
    """The Parquet files of a complete local partition, every one from the same published version: the folder is
    opened once and its files are opened through that handle, so a publish that exchanges the folder meanwhile
    (and deletes the old one, whose open files stay readable) never mixes two versions or loses a file."""
    import fnmatch

    import pyarrow as pa
    import pyarrow.parquet as pq

    what = f"{dataset} partition ds={ds_str(ds)}"
    for _ in range(_ATTEMPTS):
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
    raise OSError(f"{what} was republished {_ATTEMPTS} times while it was opened: read it again later")


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
