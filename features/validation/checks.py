"""The ``Check`` record and the first stage of the gate: storage and physical schema, with pyarrow.

``read_partition`` checks the ``_SUCCESS`` marker, at least one Parquet file, every file readable, and the
column names and types of every file against the contract in ``core.contracts``. An unreadable file or a
missing marker is a failed check naming the file, never only a stack trace. It works on any storage root
``core.storage`` knows (a local folder, ``s3://...``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from core import contracts, storage

CheckStatus = Literal["passed", "failed", "skipped"]

# Checks of the storage and physical-schema stage, in the order they run.
STORAGE_CHECKS: tuple[str, ...] = (
    "partition.marker",
    "partition.files",
    "files.readable",
    "schema.columns",
    "schema.types",
)

EXAMPLES = 10  # offending values quoted in a check's observed value


@dataclass
class Check:
    """One named check and its outcome; ``success`` is ``None`` when it was skipped."""

    name: str
    success: bool | None
    observed: Any = None
    expected: Any = None
    details: str = ""
    required: bool = True  # False: a skipped check does not fail the partition (its input lies elsewhere)
    severity: Literal["fail", "warn", "off"] = "fail"  # validation.severity: warn and off never fail the partition

    @property
    def passed(self) -> bool:
        return self.success is True or (self.success is None and not self.required) or self.severity != "fail"

    @property
    def status(self) -> CheckStatus:
        if self.success is None:
            return "skipped"
        return "passed" if self.success else "failed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "success": self.success,
            "observed": jsonable(self.observed),
            "expected": jsonable(self.expected),
            "details": self.details,
            "severity": self.severity,
        }


def dataset_name(dataset: str) -> str:
    """``events`` for ``events`` or ``raw/events``; raises ValueError naming the known datasets."""
    name = next((short for short, folder in contracts.RAW_DATASETS.items() if dataset == folder), dataset)
    if name not in contracts.RAW_DATASETS:
        known = ", ".join(sorted(contracts.RAW_DATASETS))
        raise ValueError(f"unknown raw dataset {dataset!r}: expected one of {known}")
    return name


def raw_dataset(name: str) -> str:
    """The folder of a raw dataset under the storage root: ``raw/events`` for ``events``."""
    return contracts.RAW_DATASETS[dataset_name(name)]


def day_bounds(ds: str | dt.date) -> tuple[dt.datetime, dt.datetime]:
    """The partition's UTC day as ``[start, end)``."""
    day = storage.parse_ds(ds)
    start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
    return start, start + dt.timedelta(days=1)


# --- the storage and physical-schema stage ----------------------------------------------------------------


@dataclass
class ReadPartition:
    """What the storage stage found: its checks by name, and the partition as one table when it is usable.

    ``table`` is None when a later stage cannot run, and ``skip_reason`` says why. ``bad_columns``: columns
    missing from a file or of the wrong type, which the column-level checks leave out. ``encoded``: the string
    columns asked for as dictionary codes, as the files store them (the same values as ``table``'s), when every
    file has them.
    """

    location: str
    checks: dict[str, Check]
    files: list[str] = field(default_factory=list)
    table: pa.Table | None = None
    bad_columns: set[str] = field(default_factory=set)
    skip_reason: str = ""
    encoded: dict[str, pa.ChunkedArray] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """The partition has its completion marker (only a complete partition may be quarantined)."""
        return self.checks["partition.marker"].success is True


def read_partition(root: storage.Location, dataset: str, ds: str, dictionary: Sequence[str] = ()) -> ReadPartition:
    """Run the storage and physical-schema checks of ``raw/<dataset>/ds=<ds>`` and read it into one table.

    ``dictionary``: string columns also wanted as dictionary codes (``ReadPartition.encoded``).
    """
    name = dataset_name(dataset)
    source = raw_dataset(name)
    part = storage.partition(root, source, ds)
    found = ReadPartition(location=part, checks={})
    checks = found.checks
    if not storage.exists(storage.join(part, storage.MARKER)):
        if storage.is_dir(part):
            checks["partition.marker"] = Check(
                "partition.marker",
                False,
                "missing",
                storage.MARKER,
                f"no {storage.MARKER} marker in {part}: the partition is incomplete and does not exist for readers",
            )
        else:
            from features.validation.report import quarantine_records  # report builds on these checks

            records = quarantine_records(root, name, ds)
            checks["partition.marker"] = Check(
                "partition.marker",
                False,
                "partition folder missing",
                storage.MARKER,
                f"{part} does not exist: it was quarantined ({records[-1]}: its data and report); land a fixed "
                "partition there" if records else f"{part} does not exist: the partition has not landed",
            )
        found.skip_reason = "the partition is missing or incomplete"
        return found

    checks["partition.marker"] = Check("partition.marker", True, "present", storage.MARKER)
    found.files = storage.data_files(root, source, ds)
    checks["partition.files"] = Check(
        "partition.files",
        bool(found.files),
        [storage.name_of(f) for f in found.files],
        ">= 1 *.parquet file",
        "" if found.files else f"{part} has a {storage.MARKER} marker but no *.parquet file: the partition is empty",
    )
    if not found.files:
        found.skip_reason = "the partition has no Parquet file"
        return found

    tables, readable = read_files(found.files, dictionary, found.encoded)
    checks["files.readable"] = readable
    if not readable.success:
        found.skip_reason = "a Parquet file is unreadable"
        return found
    checks["schema.columns"], checks["schema.types"], found.bad_columns = check_schema(
        [(f, t.schema) for f, t in zip(found.files, tables, strict=True)], contracts.RAW_SCHEMAS[name]
    )
    try:
        found.table = contiguous(pa.concat_tables(tables, promote_options="permissive"))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        found.skip_reason = f"the files cannot be combined into one table ({err})"
    return found


def contiguous(table: pa.Table) -> pa.Table:
    """``table`` with each fixed-width column (integers, floats, timestamps, booleans) in one chunk.

    A Parquet read gives a column in many chunks; the later stages read these columns as numpy arrays (the
    derived checks) and pandas columns (the GX suite), which is a copy of every chunk each time, but a view
    of a single chunk. Strings and lists stay as read (one chunk of strings is limited to 2 GB).
    """
    columns = []
    for field_, column in zip(table.schema, table.columns, strict=True):
        kind = field_.type
        if column.num_chunks > 1 and (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_temporal(kind)
            or pa.types.is_boolean(kind)
        ):
            column = pa.chunked_array([column.combine_chunks()], kind)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=table.schema)


def read_files(
    files: list[str], dictionary: Sequence[str] = (), encoded: dict[str, pa.ChunkedArray] | None = None
) -> tuple[list[pa.Table], Check]:
    """Every file as a table, and the ``files.readable`` check naming each file that is not readable.

    ``dictionary``: string columns to read as the dictionary codes Parquet stores them as, put into ``encoded``
    when every file has them; the tables have them decoded, as a plain read gives them.
    """
    tables: list[pa.Table] = []
    unreadable: dict[str, str] = {}
    chunks: dict[str, list[pa.Array]] = {c: [] for c in dictionary}
    for f in files:
        try:
            table, codes = _read_parquet(f, dictionary)
        except Exception:  # noqa: BLE001 - reported as a plain read reports it, below
            try:
                table, codes = storage.read_parquet(f), {}
            except Exception as err:  # noqa: BLE001 - a corrupt file raises many types; each is a data failure
                unreadable[f] = f"{type(err).__name__}: {err}"
                continue
        for col in list(chunks):
            if col in codes:
                chunks[col].extend(codes[col].chunks)
            else:
                del chunks[col]  # not a string column in this file: no codes
        tables.append(table)
    if encoded is not None and not unreadable:
        for col, parts in chunks.items():
            if parts and all(p.type.equals(parts[0].type) for p in parts):
                encoded[col] = pa.chunked_array(parts, parts[0].type)
    if unreadable:
        details = "; ".join(
            f"{path} is not a readable Parquet file (truncated or not Parquet): {msg}"
            for path, msg in unreadable.items()
        )
        return tables, Check("files.readable", False, unreadable, "every file readable as Parquet", details)
    return tables, Check("files.readable", True, {}, "every file readable as Parquet")


def _read_parquet(location: str, dictionary: Sequence[str]) -> tuple[pa.Table, dict[str, pa.ChunkedArray]]:
    """``storage.read_parquet``, and those of the ``dictionary`` columns the file stores as strings as dictionary
    codes. Parquet stores such a column as codes: reading them and decoding them costs less than a plain read, and
    a later stage that wants codes gets them without hashing every string again. The table is the plain read's."""
    if not dictionary:
        return storage.read_parquet(location), {}
    import pyarrow.parquet as pq

    if not storage.is_remote(location):
        source, fs = str(storage.local_path(location)), None
    else:
        fs, source = storage.filesystem(location)
    stored = pq.read_schema(source, filesystem=fs)
    wanted = [
        c for c in dictionary
        if c in stored.names and (pa.types.is_string(stored.field(c).type) or pa.types.is_large_string(stored.field(c).type))
    ]
    if not wanted:
        return storage.read_parquet(location), {}
    table = pq.read_table(source, filesystem=fs, read_dictionary=wanted)
    codes: dict[str, pa.ChunkedArray] = {}
    for col in wanted:
        index = table.schema.get_field_index(col)
        kind = table.schema.field(index).type
        if not pa.types.is_dictionary(kind):
            continue
        codes[col] = table.column(index)
        table = table.set_column(index, table.schema.field(index).with_type(kind.value_type), codes[col].cast(kind.value_type))
    return table, codes


def type_matches(actual: pa.DataType, contract: pa.DataType) -> bool:
    """The contract's type, or a fixed-size list of the same values where the contract has a list."""
    if actual.equals(contract):
        return True
    return (
        pa.types.is_list(contract) and pa.types.is_fixed_size_list(actual)
        and actual.value_type.equals(contract.value_type)
    )


def check_schema(schemas: list[tuple[str, pa.Schema]], contract: pa.Schema) -> tuple[Check, Check, set[str]]:
    """Column names and types of every file against the contract; also the columns GX cannot judge."""
    missing: dict[str, list[str]] = {}
    unexpected: dict[str, list[str]] = {}
    wrong: dict[str, dict[str, str]] = {}
    for path, schema in schemas:
        file_name = storage.name_of(path)
        for col in contract.names:
            if col not in schema.names:
                if not contract.field(col).nullable:  # a nullable column is optional
                    missing.setdefault(col, []).append(file_name)
            elif not type_matches(schema.field(col).type, contract.field(col).type):
                wrong.setdefault(col, {})[file_name] = str(schema.field(col).type)
        for col in schema.names:
            if col not in contract.names:
                unexpected.setdefault(col, []).append(file_name)

    columns_details = []
    if missing:
        columns_details.append(f"missing columns {sorted(missing)} (in {_files_of(missing)})")
    if unexpected:
        columns_details.append(f"unexpected columns {sorted(unexpected)} (in {_files_of(unexpected)})")
    columns = Check(
        "schema.columns",
        not missing and not unexpected,
        {"missing": sorted(missing), "unexpected": sorted(unexpected)},
        list(contract.names),
        "; ".join(columns_details),
    )
    types = Check(
        "schema.types",
        not wrong,
        {col: by_file for col, by_file in wrong.items()},
        {col: str(contract.field(col).type) for col in (wrong or contract.names)},
        "; ".join(
            f"{col} is {sorted(set(by_file.values()))} in {sorted(by_file)}, the contract says "
            f"{contract.field(col).type}"
            for col, by_file in wrong.items()
        ),
    )
    absent_optional = {
        col for col in contract.names
        if contract.field(col).nullable and any(col not in schema.names for _, schema in schemas)
    }
    return columns, types, set(missing) | set(wrong) | absent_optional


def _files_of(by_column: dict[str, list[str]]) -> str:
    return ", ".join(sorted({f for files in by_column.values() for f in files}))


# --- values in reports ----------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars, timestamps and sets turned into plain JSON types (NaN and infinities, which
    strict JSON readers refuse, into null: pandas' missing value)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=str)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def short(value: Any, limit: int = 200) -> str:
    """``value`` as text (JSON unless it is a string), cut to ``limit`` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
