"""What every feature step shares (docs/architecture.md §2–3): its DuckDB connection, its input checks and its output.

- the engine: ``DuckDBSettings`` and ``connect`` (in UTC, spilling to a fresh folder, reading an object store
  through the platform's filesystem);
- the inputs: ``require_input`` (a missing partition is a ``MissingInputError`` saying what to do),
  ``check_validated`` (``UnvalidatedInputError`` without a passed validation report), ``create_view`` over
  Parquet files, the pins snapshot as of a day (``pins_view``), ``input_versions`` (publish stamps);
- the output: ``write_query`` streams a query's result into a partition (or a shard's folder), cast to the
  contract's schema, with its ``_metadata.json``, published atomically and only if no input was republished
  meanwhile; within ``overlapped_outputs``, the next query runs while its last files encode.

The steps (``features.steps``) import this module; it imports none of them.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.config import FeaturesConfig
from core.contracts import RAW_EVENTS, RAW_PINS, USER_SEQUENCE, SequenceDigest
from core.failures import ConfigError, DataError, InfraError
from core.scratch import make_scratch
from core.storage import (
    MARKER,
    METADATA_FILE,
    data_files,
    filesystem,
    is_complete,
    is_remote,
    join,
    open_output,
    partition,
    publish,
    read_metadata,
    read_snapshot,
    read_text,
    snapshot_days,
    write_json,
    write_partition,
)
from features.sharding import Shard, shard_file, take_hash_probe
from features.validation.report import unvalidated_reason

log = logging.getLogger(__name__)


# Category and creator of a pin that is not in the day's pins snapshot.
UNKNOWN_ID = -1
# Rows per Arrow batch when streaming a query's result into its Parquet files.
BATCH_ROWS = 256 * 1024
# Parquet encoding is single-threaded and was about half of a large step (the examples): an unsharded output is cut
# into files of about FILE_BYTES of Arrow data in the query's order (part-00000, part-00001, ...), WRITER_THREADS
# encoded at once. A shard writes one file (shards already run side by side), each batch encoded as it comes.
FILE_BYTES = 64 * 1024 * 1024
WRITER_THREADS = 2
ROW_GROUP_ROWS = 64 * 1024
# A shard's file is all the next day's shard reads of its dataset, and its row groups are what that shard's DuckDB
# threads divide: a sequences shard of 8 (24,000 users, four lists of up to 50 each, one row group) was read on one
# thread. Sequence files of shards have row groups of 4,096 rows (about 5 MB): the next day's sequences shard of 8
# took 17-26% less time (docs/data.md). Other outputs' rows are small; their row groups stay as they are.
SHARD_ROW_GROUP_ROWS = {USER_SEQUENCE: 4096}


def shard_row_groups(dataset: str) -> int:
    """Rows per row group of a shard's file of ``dataset``."""
    return SHARD_ROW_GROUP_ROWS.get(dataset, ROW_GROUP_ROWS)


# The defaults of every build parameter: the platform configuration's, defined once in core.config.
DEFAULTS = FeaturesConfig()


class MissingInputError(DataError, FileNotFoundError):
    """A required input partition is missing or incomplete (a DATA failure: fail now, do not retry)."""


class InputDataError(DataError, ValueError):
    """An input partition is there but its content cannot be used (a DATA failure)."""


class UnvalidatedInputError(DataError, ValueError):
    """A raw input partition has no passed validation report for its current contents (a DATA failure)."""


@dataclass(frozen=True)
class DuckDBSettings:
    """Resources of the DuckDB engine of one build job (a shard's steps run side by side share them).

    ``memory_limit`` bounds DuckDB's own memory; joins, aggregations and sorts beyond it spill to disk
    instead of failing. ``temp_directory`` is the parent folder for spill files; each connection spills into
    its own fresh subfolder (removed afterwards, or by the next connection after a SIGKILL:
    ``core.scratch``), so concurrent builds never share files. Default: the
    system tmp. Outputs are streamed to Parquet in batches, so a large day never sits whole in Python.
    """

    threads: int = DEFAULTS.duckdb_threads
    memory_limit: str = DEFAULTS.duckdb_memory_limit
    temp_directory: str | None = None

    def __post_init__(self) -> None:
        # Checked where the settings are made (the job's machine), before any input is read.
        if self.temp_directory and not os.path.isdir(self.temp_directory):
            raise ConfigError(f"features.duckdb_temp_directory {self.temp_directory} is not a folder: create it, or "
                              "leave the setting empty (the system's temporary folder)")

    @classmethod
    def from_config(cls, features: FeaturesConfig) -> DuckDBSettings:
        return cls(features.duckdb_threads, features.duckdb_memory_limit, features.duckdb_temp_directory or None)


# The database that ``connect`` opens a cursor of instead of a database of its own: set by ``shared_database``
# (the steps of one job run side by side on one DuckDB instance, its memory limit and threads shared).
_SHARED: contextvars.ContextVar[duckdb.DuckDBPyConnection | None] = contextvars.ContextVar("duckdb_shared", default=None)


def _session(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("SET TimeZone = 'UTC'")
    # DuckDB materialises a subplan used twice (the day's events in the user aggregates) instead of scanning the
    # Parquet files again; the copy cost ~4x the scan here.
    con.execute("SET disabled_optimizers = 'common_subplan'")


@contextmanager
def shared_database(
    settings: DuckDBSettings | None = None, root: str | os.PathLike[str] | None = None
) -> Iterator[None]:
    """Within it (this context, and the threads started with a copy of it), ``connect`` gives cursors of one DuckDB
    database opened with ``settings``: queries run side by side share its memory limit, threads and spill folder."""
    with _database(settings, root) as con:
        token = _SHARED.set(con)
        try:
            yield
        finally:
            _SHARED.reset(token)


@contextmanager
def connect(
    settings: DuckDBSettings | None = None, root: str | os.PathLike[str] | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB connection with the given resources, in UTC (inside ``shared_database``: a cursor of
    that database, whose settings it has).

    With a storage ``root`` on an object store (``s3://``), DuckDB reads its Parquet files through the same
    fsspec filesystem as the rest of the platform (no DuckDB extension to download).
    """
    shared = _SHARED.get()
    if shared is None:
        with _database(settings, root) as con:
            yield con
        return
    cursor = shared.cursor()
    try:
        _session(cursor)
        yield cursor
    finally:
        cursor.close()


@contextmanager
def _database(
    settings: DuckDBSettings | None, root: str | os.PathLike[str] | None
) -> Iterator[duckdb.DuckDBPyConnection]:
    settings = settings or DuckDBSettings()
    spill = make_scratch("pinflow-duckdb-", settings.temp_directory)
    try:
        con = duckdb.connect(
            config={
                "threads": settings.threads,
                "memory_limit": settings.memory_limit,
                "temp_directory": spill,
                # Every output has an ORDER BY; without this, spilling operators can stream freely.
                "preserve_insertion_order": False,
            }
        )
        try:
            _session(con)
            take_hash_probe(con)
            if root is not None and is_remote(root):
                con.register_filesystem(filesystem(root)[0])
            yield con
        finally:
            con.close()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


# Helpers of the steps' SQL text (their column lists come from core.contracts, so the SQL cannot drift from the schemas).

def sql_list(values: Sequence[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def indent(lines: Sequence[str], spaces: int) -> str:
    return (",\n" + " " * spaces).join(lines)


def partition_ref(dataset: str, ds: str) -> str:
    return f"{dataset}/ds={ds}"


def require_input(root: str | os.PathLike[str], dataset: str, ds: str, hint: str) -> list[str]:
    """The Parquet files of a required input partition, or a MissingInputError saying what to do."""
    path = partition(root, dataset, ds)
    if not is_complete(root, dataset, ds):
        if dataset.startswith("raw/"):
            from features.validation.report import quarantine_records

            records = quarantine_records(root, dataset.removeprefix("raw/"), ds)
            if records:
                raise MissingInputError(
                    f"required input {dataset} for ds={ds} was quarantined by its validation ({records[-1]}: its data "
                    f"and report); land a fixed partition at {path} and validate it, then rerun this day"
                )
        raise MissingInputError(
            f"required input {dataset} for ds={ds} is missing or incomplete (no _SUCCESS marker in {path}); {hint}"
        )
    files = data_files(root, dataset, ds)
    if not files:
        raise MissingInputError(f"input {dataset} for ds={ds} has a _SUCCESS marker but no Parquet file in {path}")
    return files


def create_view(con: duckdb.DuckDBPyConnection, name: str, files: Sequence[str], schema: pa.Schema) -> None:
    """Expose Parquet files as view ``name``; no files gives an empty view with the contract's schema."""
    if files:
        paths = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
        # No hive partitioning: the ds=... folder must not add a column to the contract's.
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM read_parquet([{paths}], hive_partitioning = false)"
        )
    else:
        con.register(name, schema.empty_table())


def query_table(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None) -> pa.Table:
    relation = con.sql(sql, params=params)
    assert relation is not None, "a SELECT returns a relation"
    return relation.to_arrow_table()


def one_row(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[Any, ...]:
    """The single row of a query that returns exactly one (an aggregate)."""
    rows = con.execute(sql).fetchall()
    assert len(rows) == 1, f"expected one row, got {len(rows)}"
    return tuple(rows[0])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast to the contract schema exactly (column order, types, nullability: raises on a null)."""
    return table.select(schema.names).cast(schema)


def write_query(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params: dict[str, Any] | None,
    root: str | os.PathLike[str],
    dataset: str,
    ds: str,
    schema: pa.Schema,
    metadata: dict[str, Any],
    *,
    sums: Sequence[str] = (),
    sums_key: str = "sums",
    digest: SequenceDigest | None = None,
    shard: Shard | None = None,
    late_metadata: Callable[[], dict[str, Any]] | None = None,
    last_query: bool = False,
) -> dict[str, Any]:
    """Stream the result of ``sql`` into the partition ``dataset/ds`` (atomically, with ``_metadata.json``).

    Batches are cast to the contract ``schema`` as they come, so the result never sits whole in memory.
    Returns ``metadata`` with ``rows`` (and the totals of the ``sums`` columns under ``sums_key``, and the
    ``content_digest`` of what was written when a ``digest`` is given). ``late_metadata`` (queries of their own on
    ``con``, such as counts of the inputs) runs once the result is read, while its files still encode: its keys
    update ``metadata``. ``last_query``: the step's last use of ``con``, which is then closed as soon as the result is
    read, so DuckDB frees its memory while the files still encode. A ``shard`` writes its own folder in the build's
    staging area instead (:class:`Shard`). Within ``overlapped_outputs`` it returns once the result is read, and the
    output is published by the end of that block.
    """
    inputs = [str(ref) for ref in metadata.get("inputs", [])]
    unvalidated = unvalidated_inputs(root, inputs)
    if unvalidated:
        if metadata.get("skip_validation") is False:  # a checked build: its outputs must not claim more than inputs
            raise UnvalidatedInputError(
                f"{', '.join(unvalidated)} {'was' if len(unvalidated) == 1 else 'were'} built from raw partitions "
                f"without a passed validation (--skip-validation), so {dataset} ds={ds} would be too: rebuild "
                f"{'it' if len(unvalidated) == 1 else 'them'} from validated partitions, or build this day with "
                "--skip-validation as well (recorded)"
            )
        metadata = {**metadata, "unvalidated_inputs": unvalidated}
    versions = input_versions(root, inputs)
    relation = con.sql(sql, params=params)
    assert relation is not None, "a SELECT returns a relation"
    rows = 0
    totals = dict.fromkeys(sums, 0)
    target = publish(shard.folder(dataset)) if shard is not None else write_partition(root, dataset, ds)
    with ExitStack() as output:  # the files, then the publish, as they exit
        staging = output.enter_context(target)
        reader = relation.to_arrow_reader(BATCH_ROWS)
        files = (ShardFile(join(staging, shard_file(shard.index)), schema, shard_row_groups(dataset))
                 if shard else _ParquetFiles(staging, schema))
        output.enter_context(files)
        for batch in reader:
            if not batch.num_rows:
                continue
            conformed = conform(pa.Table.from_batches([batch]), schema)
            files.write(conformed)
            rows += conformed.num_rows
            for column in sums:
                totals[column] += int(pc.sum(conformed[column]).as_py() or 0)
            if digest is not None:
                digest.update(conformed)
        if late_metadata is not None:
            metadata = {**metadata, **late_metadata()}
        if last_query:
            con.close()  # ``connect`` closes it again: a no-op
        # Every input has been read: one republished meanwhile fails the output (raised inside the publish: nothing of
        # it becomes visible).
        changed = [ref for ref, version in input_versions(root, inputs).items() if versions.get(ref) != version]
        if changed:
            raise InfraError(
                f"{', '.join(changed)} {'was' if len(changed) == 1 else 'were'} republished while {dataset} ds={ds} was "
                "built from it: nothing was published; a retry builds from the new version"
            )
        summary = {**metadata, "rows": rows, "input_versions": versions} | ({sums_key: totals} if sums else {})
        if shard is not None:
            summary |= {"shard": shard.index, "shards": shard.count}
        if digest is not None:
            summary["content_digest"] = digest.hexdigest()
        write_json(join(staging, METADATA_FILE), summary)
        finishing = _FINISHING.get()
        if finishing is not None:
            finishing.add(output.pop_all())
    return summary


class _Finishing:
    """Outputs whose result has been read, finished one after another on a thread, in the order given: their last files
    encoded, then each published; once one fails, the next ones are not published either (as when each was finished
    before the next query ran)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="output-finish")
        self.error: BaseException | None = None  # the first output's that failed: the ones after it are discarded

    def add(self, output: ExitStack) -> None:
        self.pool.submit(self._finish, output)

    def _finish(self, output: ExitStack) -> None:
        if self.error is not None:  # its files are discarded, its folder removed: nothing of it becomes visible
            output.__exit__(type(self.error), self.error, self.error.__traceback__)
            return
        try:
            output.close()
        except BaseException as error:
            self.error = error
            raise

    def wait(self, *, failed: bool) -> None:
        """Wait for every output; raise the first error (log it instead when the caller ``failed`` already)."""
        self.pool.shutdown(wait=True)
        if self.error is not None and failed:
            log.error("an output was not published: %s: %s", type(self.error).__name__, self.error)
        elif self.error is not None:
            raise self.error


_FINISHING: contextvars.ContextVar[_Finishing | None] = contextvars.ContextVar("output_finishing", default=None)


@contextmanager
def overlapped_outputs() -> Iterator[None]:
    """Within it, ``write_query`` returns as soon as its result is read: the encoding of its last files and its
    publish go on on a thread while the caller runs its next query (that encoding is one core's work, 0.1-0.5 s a
    step, which left the other core idle). Every output is published, in order, by the time it ends, and the first
    error raised then (an output whose files fail is not published, nor are those after it). Nested, it joins the
    outermost one: use it around work of which nothing reads another's output before the end."""
    if _FINISHING.get() is not None:
        yield
        return
    finishing = _Finishing()
    token = _FINISHING.set(finishing)
    failed = True
    try:
        yield
        failed = False
    finally:
        _FINISHING.reset(token)
        finishing.wait(failed=failed)


def parquet_writer(sink: Any, schema: pa.Schema, *, bucketed: bool = False) -> pq.ParquetWriter:
    """The Parquet writer of a feature output (``bucketed``: a file of a hash-bucketed layout, below)."""
    # Dictionary encoding only for strings: on ids, counts and lists it costs 3x the write time for
    # nothing (it falls back to plain encoding on high-cardinality columns anyway).
    dictionary = [f.name for f in schema if pa.types.is_string(f.type)]
    if not bucketed:
        return pq.ParquetWriter(sink, schema, use_dictionary=dictionary)
    # A file of a hash-bucketed layout (a shard's output, the day's bucketed events) is read whole by the next
    # shards: LZ4 (LZ4_RAW) encodes and decodes faster than Snappy for files about 5% larger, and the statistics of
    # list columns (min/max of their elements) prune nothing. A sequences shard of 8 took 19% less time (docs/data.md).
    return pq.ParquetWriter(
        sink, schema, use_dictionary=dictionary, compression="lz4",
        write_statistics=[f.name for f in schema if not pa.types.is_list(f.type)],
    )


class ShardFile:
    """Tables written in order into the one file ``path`` (of a bucketed layout: ``parquet_writer``), each encoded on
    a writer thread as it comes (pyarrow releases the GIL): the encoding overlaps the query instead of following it
    (it was 10-15% of a shard's time). At most WRITER_THREADS + 1 tables are held. No table at all still writes the
    file (the schema)."""

    def __init__(self, path: str, schema: pa.Schema, row_group_rows: int = ROW_GROUP_ROWS):
        self.path, self.schema, self.row_group_rows = path, schema, row_group_rows
        self.files = ExitStack()
        self.running: list[Future[None]] = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="parquet-writer")  # one file: its tables in order

    def __enter__(self) -> ShardFile:
        sink = self.files.enter_context(open_output(self.path))
        self.writer = self.files.enter_context(parquet_writer(sink, self.schema, bucketed=True))
        return self

    def write(self, table: pa.Table) -> None:
        if len(self.running) > WRITER_THREADS:
            self.running.pop(0).result()
        self.running.append(self.pool.submit(self.writer.write_table, table, row_group_size=self.row_group_rows))

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is None:
                for running in self.running:
                    running.result()  # an encoding error fails the output (nothing is published)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.files.close()


class _ParquetFiles:
    """Tables written in order into ``part-00000.parquet``, ``part-00001.parquet``, ... of ``folder``, a new file
    after about FILE_BYTES of Arrow data, WRITER_THREADS encoded at once.

    A file's tables are collected, then encoded on a thread (pyarrow releases the GIL) while the next file fills;
    at most WRITER_THREADS + 1 files' tables are held. No table at all still writes one empty file (the schema).
    """

    def __init__(self, folder: str, schema: pa.Schema):
        self.folder, self.schema, self.file_bytes = folder, schema, FILE_BYTES
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.written = 0
        self.running: list[Future[None]] = []
        self.pool = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="parquet-writer")

    def __enter__(self) -> _ParquetFiles:
        return self

    def write(self, table: pa.Table) -> None:
        while self.pending_bytes + table.nbytes > self.file_bytes:
            rows = max(1, table.num_rows * (self.file_bytes - self.pending_bytes) // max(table.nbytes, 1))
            self.pending.append(table.slice(0, rows))
            table = table.slice(rows)
            self._flush()
        if table.num_rows:
            self.pending.append(table)
            self.pending_bytes += table.nbytes

    def _flush(self) -> None:
        name = shard_file(self.written)
        self.written += 1
        if len(self.running) >= WRITER_THREADS:
            self.running.pop(0).result()  # the oldest file is done before another one starts
        self.running.append(self.pool.submit(self._encode, join(self.folder, name), self.pending))
        self.pending, self.pending_bytes = [], 0

    def _encode(self, path: str, tables: list[pa.Table]) -> None:
        with open_output(path) as sink, parquet_writer(sink, self.schema) as writer:
            for table in tables:
                writer.write_table(table, row_group_size=ROW_GROUP_ROWS)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is None:
                if self.pending or not self.written:
                    self._flush()
                for running in self.running:
                    running.result()  # an encoding error fails the output (nothing is published)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def input_versions(root: str | os.PathLike[str], refs: Sequence[str]) -> dict[str, str | None]:
    """The publish stamp (``_SUCCESS`` contents) of each input partition ``dataset/ds=...`` (None: not there).

    Read before and after an output is computed: an input republished meanwhile (a concurrent rebuild) fails the
    output instead of publishing rows computed from two versions, and shards of one build must have read the
    same versions to be merged."""
    versions: dict[str, str | None] = {}
    for ref in refs:
        dataset, _, day = ref.rpartition("/ds=")
        try:
            versions[ref] = read_text(join(partition(root, dataset, day), MARKER))
        except FileNotFoundError:
            versions[ref] = None
    return versions


def unvalidated_inputs(root: str | os.PathLike[str], refs: Sequence[str]) -> list[str]:
    """The feature partitions among ``refs`` built without validation, or from such partitions (their metadata's
    ``skip_validation`` or ``unvalidated_inputs``): what an output built from them inherits. Raw partitions are
    checked by :func:`check_validated` instead."""
    found = []
    for ref in refs:
        dataset, _, day = ref.rpartition("/ds=")
        if dataset.startswith("raw/"):
            continue
        recorded = read_metadata(root, dataset, day)
        if recorded.get("skip_validation") or recorded.get("unvalidated_inputs"):
            found.append(ref)
    return found


def day_start(ds: str) -> dt.datetime:
    return dt.datetime.combine(dt.date.fromisoformat(ds), dt.time(), tzinfo=dt.UTC)


def check_positive(name: str, value: float, flag: str, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}; set {flag}")


def check_unique_pins(con: duckdb.DuckDBPyConnection, ds: str, shard: Shard | None = None) -> None:
    if shard is not None and shard.index != 0:
        return  # the same snapshot for every shard: shard 0's failure alone keeps the step from being merged
    (duplicates,) = one_row(con, "SELECT count(*) - count(DISTINCT pin_id) FROM pins")
    if duplicates:
        raise InputDataError(
            f"{RAW_PINS} ds={ds} has {duplicates} duplicated pin_id rows; a pin snapshot holds each pin "
            "once: fix or re-validate the snapshot before building features"
        )


def events_hint(ds: str) -> str:
    return f"wait for the upstream event log of {ds} to land and pass validation, then rerun this day"


def pins_hint(ds: str) -> str:
    return f"wait for the pin corpus snapshot of {ds} to land and pass validation, then rerun this day"


def check_validated(
    root: str | os.PathLike[str], days: Sequence[str], *, require_validation: bool
) -> dict[str, Any]:
    """Check that the raw events and pins partitions of ``days`` passed validation for their current contents.

    Returns the metadata entries that record it: ``skip_validation`` and, when checked, ``validated_inputs``
    (each partition's content fingerprint, as its report records it). Raises ``UnvalidatedInputError`` naming
    the first partition without a passed report for its current contents and the command that validates it.
    The older partitions a pins view builds on (``raw/pins`` increments) were checked when their own day was.
    """
    if not require_validation:
        return {"skip_validation": True}
    fingerprints: dict[str, str] = {}
    for day in days:
        for dataset in (RAW_EVENTS, RAW_PINS):
            if not is_complete(root, dataset, day):
                continue  # a missing input is the step's own error (or a gap it records)
            fingerprint, reason = unvalidated_reason(root, dataset, day)
            if reason is not None:
                name = dataset.removeprefix("raw/")
                raise UnvalidatedInputError(
                    f"{partition_ref(dataset, day)} ({partition(root, dataset, day)}) has no passed validation report for "
                    f"its current contents: {reason}. Validate it with `python -m features.validate {name} "
                    f"--root {os.fspath(root)} --ds {day}` and rerun this build; or, knowing what it holds, build "
                    "with --skip-validation (recorded in the outputs' metadata)"
                )
            fingerprints[partition_ref(dataset, day)] = fingerprint
    return {"skip_validation": False, "validated_inputs": fingerprints}


def has_raw(root: str | os.PathLike[str], day: str) -> bool:
    return is_complete(root, RAW_EVENTS, day) and is_complete(root, RAW_PINS, day)


def quoted_paths(paths: Sequence[str]) -> str:
    return ", ".join("'" + str(f).replace("'", "''") + "'" for f in paths)


def pins_source(con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], day: str) -> str:
    """A table expression of the pins snapshot as of ``day``: its Parquet files for a full snapshot, or the
    view an incremental one resolves to (``core.storage.read_snapshot``), registered in ``con``."""
    days = snapshot_days(root, RAW_PINS, day)
    if days == [day]:
        return f"read_parquet([{quoted_paths(data_files(root, RAW_PINS, day))}], hive_partitioning = false)"
    table, _ = read_snapshot(root, RAW_PINS, day, "pin_id", ["category", "creator_id"])
    name = f"pins_as_of_{day.replace('-', '_')}"
    con.register(name, table)
    return name


def pins_view(con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], day: str) -> None:
    """View ``pins``: the pins snapshot as of ``day`` (full or resolved from increments)."""
    con.execute(f"CREATE OR REPLACE TEMP VIEW pins AS SELECT pin_id, category, creator_id FROM {pins_source(con, root, day)}")
