"""Feature computation (docs/architecture.md §2–3): daily aggregates → window features → sequences → examples.

Each step is a function of explicit arguments (storage root, day, parameters) that reads complete input
partitions, computes one output with DuckDB SQL, writes it atomically with its metadata
(``_metadata.json``: rows, inputs used, missing days, parameters) and returns that metadata as a summary.
Rerunning a day replaces that day's outputs and nothing else.

    python -m features.build --root /data/pinflow --ds 2024-01-31 --step all

Builds only from validated data: every raw partition a step reads needs a passed validation report
(``python -m features.validate``) for its current contents (the content fingerprint the report records);
otherwise the step raises ``UnvalidatedInputError`` naming the partition and the command that validates it.
``--skip-validation`` (``require_validation=False``) builds anyway and says so in the outputs' metadata.

Point-in-time rule: the examples of day ``ds`` join features as of the end of ``ds-1`` only, so nothing
of day ``ds`` leaks into its own features. Raw partitions are assumed to hold the events whose ``ts``
lies in their day (the validation step checks it); sequences additionally cut on ``ts``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.config import FeaturesConfig
from core.contracts import (
    ACTIONS,
    COUNT_COLUMNS,
    DENSE_FEATURES,
    ENGAGEMENTS,
    EVENTS_BY_PIN,
    EVENTS_BY_USER,
    EVENTS_SCHEMA,
    EXAMPLES,
    EXAMPLES_SCHEMA,
    LABELS,
    PIN_DAILY,
    PIN_DAILY_SCHEMA,
    PIN_WINDOW,
    PIN_WINDOW_SCHEMA,
    RAW_EVENTS,
    RAW_PINS,
    USER_DAILY,
    USER_DAILY_SCHEMA,
    USER_SEQUENCE,
    USER_SEQUENCE_SCHEMA,
    USER_WINDOW,
    USER_WINDOW_SCHEMA,
    SequenceDigest,
    combined_digest,
)
from core.failures import (
    DataError,
    ExitCode,
    FailureClass,
    InfraError,
    PinflowError,
    classify,
    disk_full,
    exit_code_for,
)
from core.storage import (
    MARKER,
    METADATA_FILE,
    check_root,
    copy_file,
    data_files,
    day_range,
    ds_str,
    exists,
    filesystem,
    is_complete,
    is_remote,
    join,
    name_of,
    open_output,
    partition,
    publish,
    read_json,
    read_metadata,
    read_parquet,
    read_snapshot,
    read_text,
    remove_tree,
    resolve,
    shift_ds,
    snapshot_days,
    write_json,
    write_partition,
)
from features.validation.report import unvalidated_reason

if TYPE_CHECKING:
    from features.spec import BuildSpec

log = logging.getLogger(__name__)


# Category and creator of a pin that is not in the day's pins snapshot.
UNKNOWN_ID = -1
# Global rates used as the prior when no pin_window metadata is there to provide them (cold start).
DEFAULT_GLOBAL_RATES: dict[str, float] = {"ctr": 0.0, "repin_rate": 0.0, "hide_rate": 0.0}
# Rows per Arrow batch when streaming a query's result into its Parquet files.
BATCH_ROWS = 256 * 1024
# Parquet encoding is single-threaded and was about half of a large step (the examples): an unsharded output is cut
# into files of about FILE_BYTES of Arrow data in the query's order (part-00000, part-00001, ...), WRITER_THREADS
# encoded at once. A shard writes one file (shards already run side by side), each batch encoded as it comes.
FILE_BYTES = 64 * 1024 * 1024
WRITER_THREADS = 2
ROW_GROUP_ROWS = 64 * 1024
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
    """Resources of the DuckDB engine of one build step.

    ``memory_limit`` bounds DuckDB's own memory; joins, aggregations and sorts beyond it spill to disk
    instead of failing. ``temp_directory`` is the parent folder for spill files; each connection spills into
    its own fresh subfolder (removed afterwards), so concurrent builds never share files. Default: the
    system tmp. Outputs are streamed to Parquet in batches, so a large day never sits whole in Python.
    """

    threads: int = DEFAULTS.duckdb_threads
    memory_limit: str = DEFAULTS.duckdb_memory_limit
    temp_directory: str | None = None

    @classmethod
    def from_config(cls, features: FeaturesConfig) -> DuckDBSettings:
        return cls(features.duckdb_threads, features.duckdb_memory_limit, features.duckdb_temp_directory or None)


@dataclass(frozen=True)
class Shard:
    """One of ``count`` shards of a day's build step (scale-out: each shard a job, docs/architecture.md §4).

    A shard builds the rows of the users whose ``hash(user_id) % count == index`` (user outputs and examples) and
    of the pins whose ``hash(pin_id) % count == index`` (pin outputs), reading whatever else it needs whole (the
    window's global pin rates are summed over every pin). Its outputs go to ``<staging>/<dataset>/shard-NNNNN/``,
    each folder published with its marker, until :func:`merge_shards` publishes the day's partitions from every
    shard's file: rows equal to those of an unsharded build (a row's values never depend on other shards' rows).
    """

    index: int
    count: int
    staging: str

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} is not in [0, {self.count}): set --shards / --run-shards")

    def keeps(self, column: str) -> str:
        """The SQL condition of this shard's rows, by ``column`` (user_id or pin_id)."""
        return f"hash({column}) % {self.count} = {self.index}"

    def folder(self, dataset: str) -> str:
        return shard_folder(self.staging, dataset, self.index)


def shard_folder(staging: str, dataset: str, index: int) -> str:
    return join(staging, *dataset.split("/"), f"shard-{index:05d}")


def shard_file(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _keeps(shard: Shard | None, column: str) -> str:
    return shard.keeps(column) if shard is not None else "TRUE"


# --- bucketed layouts -------------------------------------------------------------------------------------
# A partition whose metadata has ``hash_buckets`` {key, count, probe} holds in file part-b exactly the rows with
# hash(key) % count = b: the merged output of a sharded step (part-i: shard i), and the day's events bucketed by
# validation (EVENTS_BY_USER, EVENTS_BY_PIN). Shard i of N needs the rows with hash % N = i, which lie in the files
# b with b % gcd(count, N) = i % gcd(count, N) (exactly those files when N divides count): it reads those only,
# and still filters them. Any other partition (unsharded, written before) is read whole and filtered, as before.
# ``probe`` is DuckDB's hash of fixed ids when the layout was written: a DuckDB whose hash differs reads whole.
_PROBE_IDS = "(VALUES (0), (1), (12345), (987654321))"
DATASET_KEYS = {
    USER_DAILY: "user_id", PIN_DAILY: "pin_id", USER_WINDOW: "user_id", PIN_WINDOW: "pin_id", USER_SEQUENCE: "user_id",
    EXAMPLES: "user_id", EVENTS_BY_USER: "user_id", EVENTS_BY_PIN: "pin_id",
}
# The columns of each bucketed copy of the events: the pin side only feeds pin_daily.
EVENT_BUCKETS: dict[str, tuple[str, str]] = {
    EVENTS_BY_USER: ("user_id", "*"),
    EVENTS_BY_PIN: ("pin_id", "pin_id, user_id, action"),
}


# This process's probe: taken on its first connection (``connect``), as a DuckDB instance costs ~15 ms of CPU.
_HASH_PROBE: list[int] = []


def _probe(con: duckdb.DuckDBPyConnection) -> int:
    if not _HASH_PROBE:
        (value,) = con.execute(f"SELECT sum(hash(v) % 1000003)::BIGINT FROM {_PROBE_IDS} AS t(v)").fetchone() or (0,)
        _HASH_PROBE.append(int(value))
    return _HASH_PROBE[0]


def hash_probe() -> int:
    """A digest of this DuckDB's ``hash()`` of fixed ids (the same in every process of one DuckDB version)."""
    if _HASH_PROBE:
        return _HASH_PROBE[0]
    con = duckdb.connect()
    try:
        return _probe(con)
    finally:
        con.close()


def hash_layout(key: str, count: int) -> dict[str, Any]:
    return {"key": key, "count": count, "probe": hash_probe()}


class ShardPart(NamedTuple):
    """What a shard reads of a partition: ``files``, and ``keeps``, the SQL condition that picks its rows of them."""

    files: list[str]
    keeps: str


def shard_part(
    root: str | os.PathLike[str], dataset: str, day: str, shard: Shard | None, files: Sequence[str] | None = None
) -> ShardPart:
    """The Parquet files of partition ``dataset/day`` that can hold ``shard``'s rows (every file without a shard, or
    when the partition records no usable ``hash_buckets`` layout), and the condition that keeps its rows: TRUE when
    the files hold exactly those (the shard count divides the layout's), as the filter costs a hash per row."""
    files = list(data_files(root, dataset, day) if files is None else files)
    key = DATASET_KEYS[dataset]
    if shard is None:
        return ShardPart(files, "TRUE")
    whole = ShardPart(files, shard.keeps(key))
    layout = read_metadata(root, dataset, day).get("hash_buckets")
    if not isinstance(layout, dict) or layout.get("key") != key or layout.get("probe") != hash_probe():
        return whole
    count = int(layout["count"])
    group = math.gcd(count, shard.count)
    by_name = {name_of(f): f for f in files}
    picked = [by_name.get(shard_file(b)) for b in range(count) if b % group == shard.index % group]
    if len(by_name) != count or None in picked:  # not the recorded layout: read every file
        return whole
    return ShardPart([f for f in picked if f is not None], "TRUE" if group == shard.count else whole.keeps)


def shard_files(
    root: str | os.PathLike[str], dataset: str, day: str, shard: Shard | None, files: Sequence[str] | None = None
) -> list[str]:
    """The files of :func:`shard_part`, for a reader that joins them to rows already the shard's."""
    return shard_part(root, dataset, day, shard, files).files


def _events_part(root: str | os.PathLike[str], day: str, shard: Shard | None, key: str = "user_id") -> ShardPart:
    """What a shard reads of the raw events of ``day``: its buckets of the bucketed copy by ``key`` when that copy
    was made from the raw partition as it is now (its publish stamp), else the raw files, filtered."""
    raw = data_files(root, RAW_EVENTS, day)
    if shard is None:
        return ShardPart(raw, "TRUE")
    dataset = EVENTS_BY_USER if key == "user_id" else EVENTS_BY_PIN
    if not is_complete(root, dataset, day):
        return ShardPart(raw, shard.keeps(key))
    current = _input_versions(root, [_ref(RAW_EVENTS, day)])[_ref(RAW_EVENTS, day)]
    if current is None or read_metadata(root, dataset, day).get("source_version") != current:
        return ShardPart(raw, shard.keeps(key))
    return shard_part(root, dataset, day, shard)


def write_event_buckets(
    root: str | os.PathLike[str], ds: str | dt.date, count: int = DEFAULTS.event_buckets, *,
    engine: DuckDBSettings | None = None,
) -> dict[str, Any]:
    """Write the raw events of ``ds`` bucketed by hash(user_id) (every column) and by hash(pin_id) (pin_id, user_id,
    action) into ``count`` files each (EVENTS_BY_USER, EVENTS_BY_PIN), so that a shard of a build reads only its part
    (``shard_part``); recorded with the raw partition's publish stamp, so a re-landed day is not read from stale
    buckets. Called by validation when the build is sharded; the summaries by dataset."""
    ds = ds_str(ds)
    if count < 1:
        raise ValueError(f"event buckets must be >= 1, got {count}; set features.event_buckets")
    events = _require(root, RAW_EVENTS, ds, _events_hint(ds))
    version = _input_versions(root, [_ref(RAW_EVENTS, ds)])[_ref(RAW_EVENTS, ds)]
    summary: dict[str, Any] = {}
    with connect(engine, root) as con:
        _view(con, "events_all", events, EVENTS_SCHEMA)
        for dataset, (key, columns) in EVENT_BUCKETS.items():
            # Sorted by bucket, so that each bucket's scan of the temp table skips the others' row groups.
            con.execute(
                f"CREATE OR REPLACE TEMP TABLE bucketed AS SELECT hash({key}) % {count} AS bucket, {columns} "
                "FROM events_all ORDER BY bucket"
            )
            rows = 0
            with write_partition(root, dataset, ds) as out:
                for bucket in range(count):
                    table = _query(con, "SELECT * EXCLUDE (bucket) FROM bucketed WHERE bucket = $b", {"b": bucket})
                    rows += table.num_rows
                    with open_output(join(out, shard_file(bucket))) as sink:
                        pq.write_table(table, sink, row_group_size=64 * 1024)
                meta = {
                    "dataset": dataset, "ds": ds, "source": _ref(RAW_EVENTS, ds), "source_version": version,
                    "rows": rows, "hash_buckets": hash_layout(key, count),
                }
                write_json(join(out, METADATA_FILE), meta)
            summary[dataset] = meta
        con.execute("DROP TABLE IF EXISTS bucketed")
    if _input_versions(root, [_ref(RAW_EVENTS, ds)])[_ref(RAW_EVENTS, ds)] != version:
        log.warning("%s was republished while it was bucketed: shards read it whole until it is bucketed again", _ref(RAW_EVENTS, ds))
    return summary


@contextmanager
def connect(
    settings: DuckDBSettings | None = None, root: str | os.PathLike[str] | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB connection with the given resources, in UTC.

    With a storage ``root`` on an object store (``s3://``), DuckDB reads its Parquet files through the same
    fsspec filesystem as the rest of the platform (no DuckDB extension to download).
    """
    settings = settings or DuckDBSettings()
    spill = tempfile.mkdtemp(prefix="pinflow-duckdb-", dir=settings.temp_directory)
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
            con.execute("SET TimeZone = 'UTC'")
            # DuckDB materialises a subplan used twice (the day's events in the user aggregates) instead of scanning
            # the Parquet files again; the copy cost ~4x the scan here.
            con.execute("SET disabled_optimizers = 'common_subplan'")
            _probe(con)
            if root is not None and is_remote(root):
                con.register_filesystem(filesystem(root)[0])
            yield con
        finally:
            con.close()
    finally:
        shutil.rmtree(spill, ignore_errors=True)


# --- SQL ------------------------------------------------------------------------------------------------
# Column lists come from core.contracts so that the SQL cannot drift from the schemas.

_ACTION_OF_COUNT = dict(zip(COUNT_COLUMNS, ACTIONS, strict=True))  # "clicks" -> "click"
_RATE_OF_ACTION = {"click": "ctr", "repin": "repin_rate", "hide": "hide_rate"}


def _sql_list(values: Sequence[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _indent(lines: Sequence[str], spaces: int) -> str:
    return (",\n" + " " * spaces).join(lines)


_DAILY_COUNTS = _indent([f"count(*) FILTER (WHERE action = '{a}') AS {c}" for c, a in _ACTION_OF_COUNT.items()], 7)
_WINDOW_SUMS = _indent([f"sum({c})::BIGINT AS {c}" for c in COUNT_COLUMNS], 9)
_ACTION_INDEX = " ".join(f"WHEN '{a}' THEN {i}" for i, a in enumerate(ACTIONS))

# Daily aggregates of one day's events. Input views: events (raw/events of ds), pins (raw/pins of ds).
# Per-category engagement takes each pin's category from the same day's pins snapshot.
USER_DAILY_SQL = f"""
WITH counts AS (
  SELECT user_id,
         {_DAILY_COUNTS},
         count(DISTINCT pin_id) AS distinct_pins
  FROM events
  GROUP BY user_id
),
per_category AS (
  SELECT e.user_id,
         coalesce(p.category, $unknown)::INTEGER AS category,
         count(*) FILTER (WHERE e.action = 'impression') AS impressions,
         count(*) FILTER (WHERE e.action <> 'impression') AS engagements
  FROM events AS e
  LEFT JOIN pins AS p ON p.pin_id = e.pin_id
  GROUP BY ALL
),
categories AS (
  -- A struct sorts by its first field: category, unique per user (cheaper than list(... ORDER BY ...)).
  SELECT user_id,
         list_sort(list({{'category': category, 'impressions': impressions, 'engagements': engagements}}))
           AS categories
  FROM per_category
  GROUP BY user_id
)
SELECT c.*, g.categories
FROM counts AS c
JOIN categories AS g ON g.user_id = c.user_id
ORDER BY c.user_id
"""

PIN_DAILY_SQL = f"""
SELECT pin_id,
       {_DAILY_COUNTS},
       count(DISTINCT user_id) AS distinct_users
FROM events
GROUP BY pin_id
ORDER BY pin_id
"""

# Window features: signed sums of rows shaped like the daily aggregates. Input views: user_parts / pin_parts
# (the count columns, the categories for users, and ``part_sign``). The full sum: every day of the window,
# sign +1. The incremental one: the previous window (+1), the new day (+1) and the day that leaves (-1);
# there a category or a pin whose sums all reach zero is dropped (DROP_ZERO), which equals the full sum
# because every event counts in a category and in a pin count (no action outside ACTIONS: the incremental
# path is taken only when no day of the window had one). Integer sums only, so the result does not depend on
# how the days were gathered (exactness).
_SIGNED_SUMS = _indent([f"sum(part_sign * {c})::BIGINT AS {c}" for c in COUNT_COLUMNS], 9)
_ANY_SUM = " OR ".join(f"sum(part_sign * {c}) <> 0" for c in COUNT_COLUMNS)
DROP_ZERO = "/* drop zero rows */"

USER_WINDOW_SQL = f"""
WITH sums AS (
  SELECT user_id,
         {_SIGNED_SUMS}
  FROM user_parts
  GROUP BY user_id
),
per_category AS (
  SELECT user_id,
         c.category AS category,
         sum(part_sign * c.impressions)::BIGINT AS impressions,
         sum(part_sign * c.engagements)::BIGINT AS engagements
  FROM (SELECT user_id, part_sign, unnest(categories) AS c FROM user_parts)
  GROUP BY ALL
  {DROP_ZERO}
),
categories AS (
  SELECT user_id,
         list_sort(list({{'category': category, 'impressions': impressions, 'engagements': engagements}}))
           AS categories
  FROM per_category
  GROUP BY user_id
)
SELECT s.*,
       CASE WHEN s.impressions > 0 THEN s.clicks::DOUBLE / s.impressions ELSE 0.0 END AS ctr,
       g.categories
FROM sums AS s
JOIN categories AS g ON g.user_id = s.user_id
ORDER BY s.user_id
"""
USER_WINDOW_DROP_ZERO = "HAVING sum(part_sign * c.impressions) <> 0 OR sum(part_sign * c.engagements) <> 0"

PIN_SUMS_SQL = f"""
CREATE OR REPLACE TEMP TABLE pin_sums AS
SELECT pin_id,
       {_SIGNED_SUMS}
FROM pin_parts
GROUP BY pin_id
{DROP_ZERO}
"""
PIN_SUMS_DROP_ZERO = f"HAVING {_ANY_SUM}"

# Totals over every pin of the window: the global rates that smooth each pin's rates.
PIN_TOTALS_SQL = """
SELECT coalesce(sum(impressions), 0)::BIGINT AS impressions,
       coalesce(sum(clicks), 0)::BIGINT AS clicks,
       coalesce(sum(repins), 0)::BIGINT AS repins,
       coalesce(sum(hides), 0)::BIGINT AS hides
FROM {source}
"""
# A shard's pin_sums hold its own pins only: its totals are the signed sums of every pin's parts (the same integers).
PIN_TOTALS_OF_ALL_PARTS = "(SELECT " + ", ".join(
    f"part_sign * {c} AS {c}" for c in ("impressions", "clicks", "repins", "hides")
) + " FROM pin_parts_all)"

# rate = (k + prior * global) / (n + prior): a pin with few impressions stays near the global rate.
SMOOTHED_MACRO = """
CREATE OR REPLACE TEMP MACRO smoothed(k, n, prior, global_rate) AS
  CASE WHEN n + prior > 0 THEN (k + prior * global_rate) / (n + prior) ELSE global_rate END
"""

PIN_WINDOW_SQL = """
SELECT *,
       smoothed(clicks, impressions, $prior, $global_ctr) AS ctr,
       smoothed(repins, impressions, $prior, $global_repin_rate) AS repin_rate,
       smoothed(hides, impressions, $prior, $global_hide_rate) AS hide_rate
FROM pin_sums
ORDER BY pin_id
"""

# The columns of a daily aggregate that the window sums, by dataset.
_PART_COLUMNS = {"user": ", ".join(["user_id", *COUNT_COLUMNS, "categories"]), "pin": ", ".join(["pin_id", *COUNT_COLUMNS])}

# Sequences. One query for both ways of building them: ``engagements`` are the engagements of some raw
# days, each with the category of its pin in the pins snapshot of the action's own day, and
# ``previous_sequence`` is the state of ds-1 (incremental: the engagements of ds only) or empty (full:
# the engagements of every day of the window). Every engagement of ds is later than any action in the
# state of ds-1, so prepending the day's most recent ones to that state keeps the total order (ts, then
# pin, then action, all descending); truncating to N and dropping actions before the window's first day
# then gives the same lists as ranking every engagement of the window (exactness), without unnesting
# the state.
ENGAGEMENTS_OF_DAY_SQL = f"""
SELECT e.user_id, e.pin_id,
       (CASE e.action {_ACTION_INDEX} END)::INTEGER AS action_idx,
       coalesce(p.category, $unknown)::INTEGER AS category,
       e.ts
FROM read_parquet([{{events}}], hive_partitioning = false) AS e
LEFT JOIN {{pins}} AS p ON p.pin_id = e.pin_id
WHERE e.action IN ({_sql_list(ENGAGEMENTS)}) AND e.ts >= $window_start AND e.ts < $window_end AND {{keeps}}
"""

_SEQ_LISTS = ("seq_pin_ids", "seq_actions", "seq_categories", "seq_ts")
_SEQ_FIELDS = ("pin_id", "action_idx", "category", "ts")
_SEQ_TYPES = ("BIGINT", "INTEGER", "INTEGER", "TIMESTAMPTZ")
_MERGED_LISTS = _indent(
    [
        f"list_concat(coalesce(list_transform(l.items, lambda x: x.{f}), []::{t}[]), coalesce(p.{s}, []::{t}[])) AS {s}"
        for s, f, t in zip(_SEQ_LISTS, _SEQ_FIELDS, _SEQ_TYPES, strict=True)
    ],
    9,
)
_KEPT_LISTS = _indent([f"{s}[1:n] AS {s}" for s in _SEQ_LISTS], 7)

# Each user's most recent engagements as one list of structs sorted descending: a struct compares field by
# field, so (ts, pin_id, action_idx) descending is the total order (the category follows from the pin and the
# day). Sorting each user's list is cheaper than a window function over all engagements.
USER_SEQUENCE_SQL = f"""
WITH latest AS (
  SELECT user_id,
         (list_reverse_sort(list({{{{'ts': ts, 'pin_id': pin_id, 'action_idx': action_idx, 'category': category}}}})))[
           1:$sequence_length
         ] AS items
  FROM ({{engagements}})
  GROUP BY user_id
),
merged AS (
  SELECT coalesce(l.user_id, p.user_id) AS user_id,
         {_MERGED_LISTS}
  FROM latest AS l
  FULL OUTER JOIN previous_sequence AS p ON p.user_id = l.user_id
),
counted AS (
  -- The lists are sorted by ts descending: the actions inside the window are a prefix.
  SELECT *, least(len(list_filter(seq_ts, lambda t: t >= $window_start)), $sequence_length) AS n
  FROM merged
)
SELECT user_id,
       {_KEPT_LISTS}
FROM counted
WHERE n > 0
ORDER BY user_id
"""


def _engagements_sql(
    con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], days: Sequence[str], shard: Shard | None = None
) -> str:
    """The engagements of ``days`` (raw events and pins of each day; a shard's), as one UNION ALL query."""
    parts = {day: _events_part(root, day, shard) for day in days}
    return "\nUNION ALL\n".join(
        ENGAGEMENTS_OF_DAY_SQL.format(
            events=_quoted(part.files), pins=_pins_source(con, root, day), keeps=part.keeps
        )
        for day, part in parts.items()
    )


def _quoted(paths: Sequence[str]) -> str:
    return ", ".join("'" + str(f).replace("'", "''") + "'" for f in paths)


def _pins_source(con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], day: str) -> str:
    """A table expression of the pins snapshot as of ``day``: its Parquet files for a full snapshot, or the
    view an incremental one resolves to (``core.storage.read_snapshot``), registered in ``con``."""
    days = snapshot_days(root, RAW_PINS, day)
    if days == [day]:
        return f"read_parquet([{_quoted(data_files(root, RAW_PINS, day))}], hive_partitioning = false)"
    table, _ = read_snapshot(root, RAW_PINS, day, "pin_id", ["category", "creator_id"])
    name = f"pins_as_of_{day.replace('-', '_')}"
    con.register(name, table)
    return name


def _pins_view(con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], day: str) -> None:
    """View ``pins``: the pins snapshot as of ``day`` (full or resolved from increments)."""
    con.execute(f"CREATE OR REPLACE TEMP VIEW pins AS SELECT pin_id, category, creator_id FROM {_pins_source(con, root, day)}")


# Negative downsampling keeps an impression when u < rate, u = the first 52 bits of
# md5('<seed>:<impression_id>') / 2^52: reproducible across reruns, engines and languages. Evaluated without
# parsing the digest: u < rate <=> those bits (an integer) < ceil(rate * 2^52) <=> the digest's hex string sorts
# before that bound written as 13 lowercase hex digits ('0'-'9' sort before 'a'-'f'; a digest whose first 13
# digits equal the bound is longer, so sorts after it). A third of the hash's cost, the same rows.
KEEP_NEGATIVE_HASH = "md5($seed_prefix || i.impression_id::VARCHAR) < $keep_below"
KEEP_NEGATIVE = "/* keep negative */"


def _keep_negative(negative_downsample: float, seed: int) -> tuple[str, dict[str, str]]:
    """The sampling condition of an impression without a positive label, and its query parameters.

    TRUE when every 52-bit value is below the bound (rate 1, or a rate within 2^-52 of it), FALSE at rate 0:
    the same rows, without an md5 per impression.
    """
    bound = math.ceil(negative_downsample * 2**52)
    if bound >= 2**52:
        return "TRUE", {}
    if bound <= 0:
        return "FALSE", {}
    return KEEP_NEGATIVE_HASH, {"seed_prefix": f"{seed}:", "keep_below": format(bound, "013x")}


_LABEL_COLUMNS = _indent([f"max((action = '{a}')::TINYINT) AS {a}" for a in LABELS], 9)
# The feature columns are computed once per user and per pin (a few hundred thousand rows), then joined: one join
# per entity instead of one per input table, and no cast per impression.
_USER_FEATURES = _indent([f"u.{c}::FLOAT AS u_{c}" for c in COUNT_COLUMNS] + ["u.ctr::FLOAT AS u_ctr"], 9)
_PIN_FEATURES = _indent(
    [f"pw.{c}::FLOAT AS p_{c}" for c in COUNT_COLUMNS] + [f"pw.{rate}::FLOAT AS p_{rate}" for rate in _RATE_OF_ACTION.values()],
    9,
)
# An impression of a user or pin without features (new to the window) gets zero counts and the prior rates.
_USER_DEFAULTS = _indent([f"coalesce(uf.u_{c}, 0.0::FLOAT) AS u_{c}" for c in (*COUNT_COLUMNS, "ctr")], 7)
_PIN_DEFAULTS = _indent(
    [f"coalesce(pf.p_{c}, 0.0::FLOAT) AS p_{c}" for c in COUNT_COLUMNS]
    + [
        f"coalesce(pf.p_{rate}, smoothed(0, 0, $prior, $global_{rate})::FLOAT) AS p_{rate}"
        for rate in _RATE_OF_ACTION.values()
    ],
    7,
)
_LABEL_VALUES = _indent([f"coalesce(l.{a}, 0)::TINYINT AS {a}" for a in LABELS], 7)
_ANY_POSITIVE_L = " OR ".join(f"l.{a} = 1" for a in LABELS)
_LABEL_NAMES = ", ".join(f"i.{a}" for a in LABELS)

# Examples: impressions of ds (view events) + labels of ds + features as of ds-1 (views user_window,
# pin_window, user_sequence: empty when missing) + pin attributes of the ds snapshot (view pins).
EXAMPLES_SQL = f"""
WITH labels AS (
  SELECT impression_id,
         {_LABEL_COLUMNS}
  FROM events
  WHERE action <> 'impression'
  GROUP BY impression_id
),
-- Downsampling first, so that features are joined for the kept impressions only.
sampled AS (
  SELECT i.impression_id, i.ts, i.user_id, i.pin_id, i.surface,
         {_LABEL_VALUES}
  FROM events AS i
  LEFT JOIN labels AS l ON l.impression_id = i.impression_id
  WHERE i.action = 'impression'
    AND ({_ANY_POSITIVE_L} OR {KEEP_NEGATIVE})
),
user_features AS (
  SELECT coalesce(u.user_id, s.user_id) AS user_id,
         {_USER_FEATURES},
         s.seq_len
  FROM user_window AS u
  FULL JOIN (SELECT user_id, len(seq_ts) AS seq_len FROM user_sequence) AS s ON s.user_id = u.user_id
),
pin_features AS (
  SELECT coalesce(p.pin_id, pw.pin_id) AS pin_id, p.category, p.creator_id,
         {_PIN_FEATURES}
  FROM pins AS p
  FULL JOIN pin_window AS pw ON pw.pin_id = p.pin_id
)
SELECT i.impression_id, i.ts, i.user_id, i.pin_id,
       coalesce(pf.category, $unknown)::INTEGER AS category,
       coalesce(pf.creator_id, $unknown)::BIGINT AS creator_id,
       i.surface,
       {_USER_DEFAULTS},
       {_PIN_DEFAULTS},
       $seq_ds::DATE AS seq_ds,
       coalesce(uf.seq_len, 0)::INTEGER AS seq_len,
       {_LABEL_NAMES}
FROM sampled AS i
LEFT JOIN pin_features AS pf ON pf.pin_id = i.pin_id
LEFT JOIN user_features AS uf ON uf.user_id = i.user_id
ORDER BY i.impression_id
"""
# The user's sequence is referenced, not copied: ``seq_ds`` (= ds-1) and ``seq_len`` (the number of its actions
# the example sees, all of them: every action of ds-1 is before the impression) point at the user's row of
# ``features/user_sequence`` of ds-1, and readers (``training.data``) resolve them into the four lists, with
# seq_age_hours = (impression ts - action ts) in hours as FLOAT. Copying lists of 50 into every example was
# most of the day's time and of its bytes.

# Of the shard's impressions (every one unsharded); the merge sums the shards'.
IMPRESSION_COUNTS_SQL = """
SELECT count(*) AS impressions,
       count(*) FILTER (WHERE pin_id NOT IN (SELECT pin_id FROM pins)) AS unknown_pin
FROM events
WHERE action = 'impression'
"""


# --- helpers --------------------------------------------------------------------------------------------


def _ref(dataset: str, ds: str) -> str:
    return f"{dataset}/ds={ds}"


def _require(root: str | os.PathLike[str], dataset: str, ds: str, hint: str) -> list[str]:
    """The Parquet files of a required input partition, or a MissingInputError saying what to do."""
    path = partition(root, dataset, ds)
    if not is_complete(root, dataset, ds):
        raise MissingInputError(
            f"required input {dataset} for ds={ds} is missing or incomplete (no _SUCCESS marker in {path}); {hint}"
        )
    files = data_files(root, dataset, ds)
    if not files:
        raise MissingInputError(f"input {dataset} for ds={ds} has a _SUCCESS marker but no Parquet file in {path}")
    return files


def _view(con: duckdb.DuckDBPyConnection, name: str, files: Sequence[str], schema: pa.Schema) -> None:
    """Expose Parquet files as view ``name``; no files gives an empty view with the contract's schema."""
    if files:
        paths = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
        # No hive partitioning: the ds=... folder must not add a column to the contract's.
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM read_parquet([{paths}], hive_partitioning = false)"
        )
    else:
        con.register(name, schema.empty_table())


def _query(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None) -> pa.Table:
    relation = con.sql(sql, params=params)
    assert relation is not None, "a SELECT returns a relation"
    return relation.to_arrow_table()


def _row(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[Any, ...]:
    """The single row of a query that returns exactly one (an aggregate)."""
    rows = con.execute(sql).fetchall()
    assert len(rows) == 1, f"expected one row, got {len(rows)}"
    return tuple(rows[0])


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast to the contract schema exactly (column order, types, nullability: raises on a null)."""
    return table.select(schema.names).cast(schema)


def _write_query(
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
    transform: Callable[[pa.Table], pa.Table] | None = None,
    digest: SequenceDigest | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Stream the result of ``sql`` into the partition ``dataset/ds`` (atomically, with ``_metadata.json``).

    Batches (passed through ``transform`` first, if given) are cast to the contract ``schema`` as they
    come, so the result never sits whole in memory.
    Returns ``metadata`` with ``rows`` (and the totals of the ``sums`` columns under ``sums_key``, and the
    ``content_digest`` of what was written when a ``digest`` is given). A ``shard`` writes its own folder in
    the build's staging area instead (:class:`Shard`).
    """
    inputs = [str(ref) for ref in metadata.get("inputs", [])]
    versions = _input_versions(root, inputs)
    relation = con.sql(sql, params=params)
    assert relation is not None, "a SELECT returns a relation"
    rows = 0
    totals = dict.fromkeys(sums, 0)
    target = publish(shard.folder(dataset)) if shard is not None else write_partition(root, dataset, ds)
    with target as staging:
        reader = relation.to_arrow_reader(BATCH_ROWS)
        files = _ParquetFile(join(staging, shard_file(shard.index)), schema) if shard else _ParquetFiles(staging, schema)
        with files:
            for batch in reader:
                if not batch.num_rows:
                    continue
                table = pa.Table.from_batches([batch])
                conformed = _conform(transform(table) if transform else table, schema)
                files.write(conformed)
                rows += conformed.num_rows
                for column in sums:
                    totals[column] += int(pc.sum(conformed[column]).as_py() or 0)
                if digest is not None:
                    digest.update(conformed)
        changed = [ref for ref, version in _input_versions(root, inputs).items() if versions.get(ref) != version]
        if changed:  # raised inside the publish: nothing of this output becomes visible
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
    return summary


def _parquet_writer(sink: Any, schema: pa.Schema) -> pq.ParquetWriter:
    # Dictionary encoding only for strings: on ids, counts and lists it costs 3x the write time for
    # nothing (it falls back to plain encoding on high-cardinality columns anyway).
    return pq.ParquetWriter(sink, schema, use_dictionary=[f.name for f in schema if pa.types.is_string(f.type)])


class _ParquetFile:
    """Tables written in order into the one file ``path``, each encoded on a writer thread as it comes (pyarrow
    releases the GIL): the encoding overlaps the query instead of following it (it was 10-15% of a shard's time).
    At most WRITER_THREADS + 1 tables are held. No table at all still writes the file (the schema)."""

    def __init__(self, path: str, schema: pa.Schema):
        self.path, self.schema = path, schema
        self.files = ExitStack()
        self.running: list[Future[None]] = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="parquet-writer")  # one file: its tables in order

    def __enter__(self) -> _ParquetFile:
        self.writer = self.files.enter_context(_parquet_writer(self.files.enter_context(open_output(self.path)), self.schema))
        return self

    def write(self, table: pa.Table) -> None:
        if len(self.running) > WRITER_THREADS:
            self.running.pop(0).result()
        self.running.append(self.pool.submit(self.writer.write_table, table, row_group_size=ROW_GROUP_ROWS))

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
        with open_output(path) as sink, _parquet_writer(sink, self.schema) as writer:
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


def _input_versions(root: str | os.PathLike[str], refs: Sequence[str]) -> dict[str, str | None]:
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


def _sequence_digest(root: str | os.PathLike[str], ds: str, files: Sequence[str]) -> str:
    """The content digest of ``features/user_sequence`` of ``ds``: the one its build recorded, else computed."""
    recorded = read_metadata(root, USER_SEQUENCE, ds).get("content_digest")
    if isinstance(recorded, str):
        return recorded
    digest = SequenceDigest()
    for f in files:
        digest.update(_conform(read_parquet(f), USER_SEQUENCE_SCHEMA))
    return digest.hexdigest()


def _day_start(ds: str) -> dt.datetime:
    return dt.datetime.combine(dt.date.fromisoformat(ds), dt.time(), tzinfo=dt.UTC)


def _check_positive(name: str, value: float, flag: str, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}; set {flag}")


def _check_unique_pins(con: duckdb.DuckDBPyConnection, ds: str, shard: Shard | None = None) -> None:
    if shard is not None and shard.index != 0:
        return  # the same snapshot for every shard: shard 0's failure alone keeps the step from being merged
    (duplicates,) = _row(con, "SELECT count(*) - count(DISTINCT pin_id) FROM pins")
    if duplicates:
        raise InputDataError(
            f"{RAW_PINS} ds={ds} has {duplicates} duplicated pin_id rows; a pin snapshot holds each pin "
            "once: fix or re-validate the snapshot before building features"
        )


def _events_hint(ds: str) -> str:
    return f"wait for the upstream event log of {ds} to land and pass validation, then rerun this day"


def _pins_hint(ds: str) -> str:
    return f"wait for the pin corpus snapshot of {ds} to land and pass validation, then rerun this day"


def _check_validated(
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
                    f"{_ref(dataset, day)} ({partition(root, dataset, day)}) has no passed validation report for "
                    f"its current contents: {reason}. Validate it with `python -m features.validate {name} "
                    f"--root {os.fspath(root)} --ds {day}` and rerun this build; or, knowing what it holds, build "
                    "with --skip-validation (recorded in the outputs' metadata)"
                )
            fingerprints[_ref(dataset, day)] = fingerprint
    return {"skip_validation": False, "validated_inputs": fingerprints}


def _daily_version(root: str | os.PathLike[str], day: str) -> str | None:
    """The publish stamps (``_SUCCESS`` contents) of ``day``'s user_daily and pin_daily; None if one is incomplete.

    A rebuild of either partition changes it: an incremental window subtracts a day only if its aggregates
    are still those the previous window added.
    """
    try:
        return "|".join(read_text(join(partition(root, d, day), MARKER)) for d in (USER_DAILY, PIN_DAILY))
    except FileNotFoundError:
        return None


def _has_raw(root: str | os.PathLike[str], day: str) -> bool:
    return is_complete(root, RAW_EVENTS, day) and is_complete(root, RAW_PINS, day)


# --- steps ----------------------------------------------------------------------------------------------


def build_daily(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    *,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Write ``features/user_daily`` and ``features/pin_daily`` of ``ds`` from that day's events only.

    Per-category engagement takes the category of each pin from the pins snapshot of ``ds``. The metadata
    counts ``unknown_action_events`` (an action outside the contract's, possible only without validation):
    a window over such a day is always a full sum.
    """
    ds = ds_str(ds)
    _require(root, RAW_EVENTS, ds, _events_hint(ds))
    _require(root, RAW_PINS, ds, _pins_hint(ds))  # the day's snapshot (or increment) has landed
    base: dict[str, Any] = {
        "step": "daily",
        "ds": ds,
        "inputs": [_ref(RAW_EVENTS, ds), _ref(RAW_PINS, ds)],
        "missing_days": [],
        **_check_validated(root, [ds], require_validation=require_validation),
    }
    summary: dict[str, Any] = {}
    counts = (
        "SELECT count(*), count(*) FILTER (WHERE action IS NULL OR action NOT IN "
        f"({_sql_list(ACTIONS)})) FROM events"
    )
    with connect(engine, root) as con:
        _pins_view(con, root, ds)
        _check_unique_pins(con, ds, shard)
        for dataset, sql, schema in ((USER_DAILY, USER_DAILY_SQL, USER_DAILY_SCHEMA), (PIN_DAILY, PIN_DAILY_SQL, PIN_DAILY_SCHEMA)):
            key = "user_id" if dataset == USER_DAILY else "pin_id"
            # A shard reads its buckets of the day (by user for users, by pin for pins) and counts its own events:
            # the merge sums the counts (each event is in one shard of each side).
            part = _events_part(root, ds, shard, key)
            _view(con, "events_all", part.files, EVENTS_SCHEMA)
            con.execute(f"CREATE OR REPLACE TEMP VIEW events AS SELECT * FROM events_all WHERE {part.keeps}")
            if shard is not None or dataset == USER_DAILY:
                events_rows, unknown = _row(con, counts)
                base["events"] = int(events_rows)
                base["unknown_action_events"] = int(unknown)
            summary[dataset] = _write_query(
                con, sql, {"unknown": UNKNOWN_ID} if dataset == USER_DAILY else None,
                root, dataset, ds, schema, {**base, "dataset": dataset}, shard=shard,
            )
    return summary


def _classify_days(
    root: str | os.PathLike[str], days: Sequence[str], *, recompute: bool
) -> tuple[list[str], list[str], list[str]]:
    """(days with complete daily partitions, days to compute from raw, missing days) of a full window sum.

    A day's aggregates come from its complete daily partitions; when those are missing (or ``recompute``),
    from that day's raw events and pins; a day without complete raw events and pins is missing.
    """
    stored: list[str] = []
    computed: list[str] = []
    missing: list[str] = []
    for day in days:
        if not recompute and is_complete(root, USER_DAILY, day) and is_complete(root, PIN_DAILY, day):
            stored.append(day)
        elif _has_raw(root, day):
            computed.append(day)
        else:
            missing.append(day)
    return stored, computed, missing


def _daily_sources(
    con: duckdb.DuckDBPyConnection, root: str | os.PathLike[str], stored: Sequence[str], computed: Sequence[str]
) -> None:
    """Create views ``user_daily`` and ``pin_daily`` over the daily aggregates of ``stored`` and ``computed`` days.

    Those of a computed day are computed here from its raw events and pins with the same SQL, in memory (the
    day's own partitions are left to its own run, so nothing outside ``ds`` is written).
    """
    for name, dataset, sql, schema in (
        ("user_daily", USER_DAILY, USER_DAILY_SQL, USER_DAILY_SCHEMA),
        ("pin_daily", PIN_DAILY, PIN_DAILY_SQL, PIN_DAILY_SCHEMA),
    ):
        parts: list[str] = []
        files = [f for day in stored for f in data_files(root, dataset, day)]
        if files:
            _view(con, f"{name}_stored", files, schema)
            parts.append(f"SELECT * FROM {name}_stored")
        for i, day in enumerate(computed):
            _view(con, "events", data_files(root, RAW_EVENTS, day), EVENTS_SCHEMA)
            _pins_view(con, root, day)
            _check_unique_pins(con, day)
            con.execute(f"CREATE OR REPLACE TEMP TABLE {name}_raw_{i} AS {sql}", {"unknown": UNKNOWN_ID} if name == "user_daily" else None)
            parts.append(f"SELECT * FROM {name}_raw_{i}")
        if parts:
            con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS " + " UNION ALL BY NAME ".join(parts))
        else:
            _view(con, name, [], schema)


def _incremental_window(
    root: str | os.PathLike[str], ds: str, days: Sequence[str], window_days: int
) -> tuple[dict[str, Any] | None, str]:
    """The plan of an incremental window of ``ds`` and why; None (and why not) when it must be a full sum.

    Incremental when the windows of ``ds-1`` are complete, were built with the same ``window_days`` from
    daily partitions only, and every day they summed is still the same (the publish stamps of its daily
    partitions, ``daily_versions``), every day they lacked still has no data, ``ds`` has its daily partitions,
    and no day of the window has an action outside the contract (``unknown_action_days``).
    """
    previous_ds = shift_ds(ds, -1)
    previous = _ref(USER_WINDOW, previous_ds)
    if not (is_complete(root, USER_WINDOW, previous_ds) and is_complete(root, PIN_WINDOW, previous_ds)):
        return None, f"{previous} is missing"
    meta = read_metadata(root, USER_WINDOW, previous_ds)
    versions = meta.get("daily_versions")
    if meta.get("window_days") != window_days:
        return None, f"{previous} was built with window_days={meta.get('window_days')}, not {window_days}"
    if not isinstance(versions, dict) or read_metadata(root, PIN_WINDOW, previous_ds).get("daily_versions") != versions:
        return None, f"{previous} and {_ref(PIN_WINDOW, previous_ds)} record no common daily_versions"
    if meta.get("computed_from_raw"):
        return None, f"{previous} computed {', '.join(meta['computed_from_raw'])} from raw events"
    if meta.get("unknown_action_days") != []:
        return None, f"{previous} sums days with actions outside the contract: {meta.get('unknown_action_days')}"
    version = _daily_version(root, ds)
    if version is None:
        return None, f"the daily aggregates of {ds} are missing"
    if read_metadata(root, USER_DAILY, ds).get("unknown_action_events") != 0:
        return None, f"{_ref(USER_DAILY, ds)} counts events with actions outside the contract"
    leaving = shift_ds(ds, -window_days)
    for day in [leaving, *days[:-1]]:
        recorded = versions.get(day)
        if recorded is not None and _daily_version(root, day) != recorded:
            return None, f"the daily aggregates of {day} were rebuilt since {previous} was built"
        if recorded is None and day != leaving and (_daily_version(root, day) is not None or _has_raw(root, day)):
            return None, f"{day} was missing from {previous} and has data now"
    plan = {
        "previous_ds": previous_ds,
        "leaving": leaving if leaving in versions else None,
        "daily_versions": {d: v for d, v in versions.items() if d >= days[0]} | {ds: version},
        "missing_days": sorted(d for d in meta.get("missing_days", []) if d >= days[0]),
    }
    reason = f"{previous} + {ds}" + (f" - {leaving}" if plan["leaving"] else f" ({leaving} was missing)")
    return plan, reason


def build_window(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    window_days: int = DEFAULTS.window_days,
    prior_impressions: float = DEFAULTS.pin_prior_impressions,
    *,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Write ``features/user_window`` and ``features/pin_window`` as of the end of ``ds``.

    Sums the daily aggregates of the days ``[ds-window_days+1, ds]`` (never rescans a window of raw
    events). Incremental when it can be (see ``_incremental_window``): the windows of ``ds-1`` plus the
    aggregates of ``ds`` minus those of the day that leaves, which equals the full sum; otherwise the full
    sum (``mode`` and ``mode_reason`` in the metadata say which and why). In a full sum, a day whose daily
    partitions are missing is computed on demand from its raw partitions and listed in ``computed_from_raw``;
    a day without raw data either is listed in ``missing_days`` (a gap) and logged; ``ds`` itself must be
    there. ``recompute`` computes every day from raw (the full recompute that the incremental path must
    equal). Pin rates are smoothed towards the window's global rates with ``prior_impressions``
    pseudo-impressions; the global rates are recorded in the pin_window metadata (``global_rates``).
    """
    ds = ds_str(ds)
    _check_positive("window_days", window_days, "--window-days")
    _check_positive("prior_impressions", prior_impressions, "--prior-impressions", allow_zero=True)
    days = day_range(shift_ds(ds, -(window_days - 1)), ds)
    params = {"window_days": window_days, "prior_impressions": prior_impressions}
    plan, reason = (None, "recompute requested") if recompute else _incremental_window(root, ds, days, window_days)
    inputs: dict[str, list[str]] = {}
    with connect(engine, root) as con:
        if plan is not None:
            computed: list[str] = []
            stored, missing = sorted(plan["daily_versions"]), plan["missing_days"]
            validation = _check_validated(root, [], require_validation=require_validation)  # reads no raw data
            daily_versions, unknown_action_days = plan["daily_versions"], []
            for name, window, daily in (("user", USER_WINDOW, USER_DAILY), ("pin", PIN_WINDOW, PIN_DAILY)):
                signed = [(window, plan["previous_ds"], 1), (daily, ds, 1)]
                if plan["leaving"]:
                    signed.append((daily, plan["leaving"], -1))
                for view, of_shard in ((f"{name}_parts_all", None), (f"{name}_parts", shard)):
                    parts = [(shard_part(root, dataset, day, of_shard), sign) for dataset, day, sign in signed]
                    selects = [
                        f"SELECT {_PART_COLUMNS[name]}, {sign} AS part_sign "
                        f"FROM read_parquet([{_quoted(part.files)}], hive_partitioning = false) WHERE {part.keeps}"
                        for part, sign in parts
                    ]
                    # A shard reads only the files of its users / pins (``shard_part``); the pin totals every pin.
                    con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS " + "\nUNION ALL\n".join(selects))
                inputs[name] = [_ref(dataset, day) for dataset, day, _ in signed]
        else:
            stored, computed, missing = _classify_days(root, days, recompute=recompute)
            if ds in missing:
                raise MissingInputError(
                    f"features/user_daily and features/pin_daily for ds={ds} are missing and so is raw data to "
                    f"compute them; run `python -m features.build --step daily --ds {ds}` once "
                    f"{RAW_EVENTS} and {RAW_PINS} of {ds} have landed"
                )
            validation = _check_validated(root, computed, require_validation=require_validation)
            # Read before the aggregates are: a day rebuilt meanwhile then only makes the next day's window full.
            daily_versions = {d: v for d in stored if (v := _daily_version(root, d)) is not None}
            unknown_action_days = computed + [
                d for d in stored if read_metadata(root, USER_DAILY, d).get("unknown_action_events") != 0
            ]
            _daily_sources(con, root, stored, computed)
            for name in ("user", "pin"):
                con.execute(
                    f"CREATE OR REPLACE TEMP VIEW {name}_parts_all AS SELECT {_PART_COLUMNS[name]}, 1 AS part_sign "
                    f"FROM {name}_daily"
                )
                con.execute(
                    f"CREATE OR REPLACE TEMP VIEW {name}_parts AS SELECT * FROM {name}_parts_all "
                    f"WHERE {_keeps(shard, f'{name}_id')}"
                )
                daily = USER_DAILY if name == "user" else PIN_DAILY
                inputs[name] = [_ref(daily, d) for d in stored] + [
                    ref for d in computed for ref in (_ref(RAW_EVENTS, d), _ref(RAW_PINS, d))
                ]
        if missing:
            log.warning("window of ds=%s: no data for %s (not in the window)", ds, ", ".join(missing))
        mode = "incremental" if plan is not None else "recompute" if recompute else "full"
        log.info("window of ds=%s: %s (%s)", ds, mode, reason)
        base = {
            "step": "window",
            "ds": ds,
            "mode": mode,
            "mode_reason": reason,
            "window_start": days[0],
            "window_end": ds,
            "computed_from_raw": computed,
            "missing_days": missing,
            "daily_versions": daily_versions,
            "unknown_action_days": unknown_action_days,
            **validation,
            **params,
        }
        summary: dict[str, Any] = {
            f"features/{name}_window": {**base, "dataset": f"features/{name}_window", "inputs": inputs[name]}
            for name in ("user", "pin")
        }
        drop_zero = plan is not None
        summary[USER_WINDOW] = _write_query(
            con, USER_WINDOW_SQL.replace(DROP_ZERO, USER_WINDOW_DROP_ZERO if drop_zero else ""), None,
            root, USER_WINDOW, ds, USER_WINDOW_SCHEMA, summary[USER_WINDOW], shard=shard,
        )
        con.execute(PIN_SUMS_SQL.replace(DROP_ZERO, PIN_SUMS_DROP_ZERO if drop_zero else ""))
        totals_row = _row(con, PIN_TOTALS_SQL.format(source="pin_sums" if shard is None else PIN_TOTALS_OF_ALL_PARTS))
        totals = dict(zip(("impressions", "clicks", "repins", "hides"), map(int, totals_row), strict=True))
        if totals["impressions"] > 0:
            global_rates = {
                "ctr": totals["clicks"] / totals["impressions"],
                "repin_rate": totals["repins"] / totals["impressions"],
                "hide_rate": totals["hides"] / totals["impressions"],
            }
            source = "window"
        else:
            global_rates, source = dict(DEFAULT_GLOBAL_RATES), "defaults"
        con.execute(SMOOTHED_MACRO)
        pin_params = {"prior": prior_impressions} | {f"global_{k}": v for k, v in global_rates.items()}
        pin_meta = summary[PIN_WINDOW] | {
            "totals": totals,
            "global_rates": global_rates,
            "global_rates_source": source,
        }
        summary[PIN_WINDOW] = _write_query(
            con, PIN_WINDOW_SQL, pin_params, root, PIN_WINDOW, ds, PIN_WINDOW_SCHEMA, pin_meta, shard=shard
        )
    return summary


def build_sequences(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    sequence_length: int = DEFAULTS.sequence_length,
    window_days: int = DEFAULTS.window_days,
    *,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Write ``features/user_sequence`` as of the end of ``ds``: each user's last N engagements.

    Incremental when the sequences of ``ds-1`` are complete and were built with the same parameters:
    they are merged with the engagements of ``ds``. Otherwise (or with ``recompute``) a full recompute
    from the raw events of the window's days that exist (missing ones recorded). Both drop actions
    before the window's first day and rank by (ts, pin_id, action) descending, so an incremental build
    equals a full recompute. Users without any action left are not written.
    """
    ds = ds_str(ds)
    _check_positive("sequence_length", sequence_length, "--sequence-length")
    _check_positive("window_days", window_days, "--window-days")
    window_start = shift_ds(ds, -(window_days - 1))
    days = day_range(window_start, ds)
    previous_ds = shift_ds(ds, -1)
    _require(root, RAW_PINS, ds, _pins_hint(ds))  # the day's snapshot (or increment) has landed
    _require(root, RAW_EVENTS, ds, _events_hint(ds))

    params = {"sequence_length": sequence_length, "window_days": window_days}
    mode, reason = "full", f"{_ref(USER_SEQUENCE, previous_ds)} is missing"
    previous_meta: dict[str, Any] = {}
    if recompute:
        reason = "recompute requested"
    elif is_complete(root, USER_SEQUENCE, previous_ds):
        previous_meta = read_metadata(root, USER_SEQUENCE, previous_ds)
        previous_params = {k: previous_meta.get(k) for k in params}
        if previous_params == params:
            mode, reason = (
                "incremental",
                f"merged {_ref(USER_SEQUENCE, previous_ds)} with {_ref(RAW_EVENTS, ds)}",
            )
        else:
            reason = f"{_ref(USER_SEQUENCE, previous_ds)} was built with {previous_params}, not {params}"

    with connect(engine, root) as con:
        _pins_view(con, root, ds)
        _check_unique_pins(con, ds, shard)
        if mode == "incremental":
            previous = shard_part(root, USER_SEQUENCE, previous_ds, shard)
            _view(con, "previous_all", previous.files, USER_SEQUENCE_SCHEMA)
            con.execute(f"CREATE OR REPLACE TEMP VIEW previous_sequence AS SELECT * FROM previous_all WHERE {previous.keeps}")
            validation = _check_validated(root, [ds], require_validation=require_validation)
            engagements = _engagements_sql(con, root, [ds], shard)
            inputs = [_ref(USER_SEQUENCE, previous_ds), _ref(RAW_EVENTS, ds), _ref(RAW_PINS, ds)]
            carried = previous_meta.get("missing_days", [])
            missing_days = sorted(d for d in carried if d >= window_start)
        else:
            # A day needs its events and its pins snapshot (the categories of its actions).
            present = [d for d in days[:-1] if _has_raw(root, d)]
            validation = _check_validated(root, [*present, ds], require_validation=require_validation)
            _view(con, "previous_sequence", [], USER_SEQUENCE_SCHEMA)
            engagements = _engagements_sql(con, root, [*present, ds], shard)
            inputs = [_ref(raw, d) for d in [*present, ds] for raw in (RAW_EVENTS, RAW_PINS)]
            missing_days = sorted(set(days) - set(present) - {ds})
        if missing_days:
            log.warning("sequences of ds=%s: no events for %s (not in the sequences)", ds, ", ".join(missing_days))
        metadata = {
            "step": "sequences",
            "dataset": USER_SEQUENCE,
            "ds": ds,
            "mode": mode,
            "mode_reason": reason,
            "window_start": window_start,
            "window_end": ds,
            "inputs": inputs,
            "missing_days": missing_days,
            **validation,
            **params,
        }
        sql_params = {
            "window_start": _day_start(window_start),
            "window_end": _day_start(shift_ds(ds, 1)),
            "sequence_length": sequence_length,
            "unknown": UNKNOWN_ID,
        }
        sql = USER_SEQUENCE_SQL.format(engagements=engagements)
        summary = _write_query(
            con, sql, sql_params, root, USER_SEQUENCE, ds, USER_SEQUENCE_SCHEMA, metadata, digest=SequenceDigest(),
            shard=shard,
        )
    return {USER_SEQUENCE: summary}


def build_examples(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    prior_impressions: float = DEFAULTS.pin_prior_impressions,
    negative_downsample: float = DEFAULTS.negative_downsample,
    seed: int = DEFAULTS.negative_downsample_seed,
    *,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Write ``examples`` of ``ds``: one row per impression of ds with its labels and its features.

    Features are those of the end of ``ds-1`` only (point in time). A missing ds-1 feature partition is
    an error naming it when the raw events of ds-1 are there (build that day first: the DAG's
    ``depends_on_past`` does); when ds-1 has no raw events either (the first day, or a gap), its users
    and pins get zero counts, the prior rates (the global rates of the ds-1 pin_window metadata, else
    DEFAULT_GLOBAL_RATES) and an empty sequence, and the partitions are listed in ``missing_inputs``.
    Impressions without a positive label are kept with probability ``negative_downsample`` (a hash of
    ``impression_id`` and ``seed``, so a rerun keeps the same rows); the rate, and the weight
    ``1/negative_downsample`` that undoes it, are in the metadata.
    """
    ds = ds_str(ds)
    _check_positive("prior_impressions", prior_impressions, "--prior-impressions", allow_zero=True)
    if not 0.0 <= negative_downsample <= 1.0:
        raise ValueError(
            f"negative_downsample must be in [0, 1], got {negative_downsample!r}; set --negative-downsample"
        )
    features_ds = shift_ds(ds, -1)
    _require(root, RAW_EVENTS, ds, _events_hint(ds))
    _require(root, RAW_PINS, ds, _pins_hint(ds))  # the day's snapshot (or increment) has landed
    feature_inputs = (
        ("user_window", USER_WINDOW, USER_WINDOW_SCHEMA),
        ("pin_window", PIN_WINDOW, PIN_WINDOW_SCHEMA),
        ("user_sequence", USER_SEQUENCE, USER_SEQUENCE_SCHEMA),
    )
    missing_inputs = [_ref(d, features_ds) for _, d, _ in feature_inputs if not is_complete(root, d, features_ds)]
    if missing_inputs and is_complete(root, RAW_EVENTS, features_ds):
        raise MissingInputError(
            f"examples of ds={ds} need the features as of the end of {features_ds}, but "
            f"{', '.join(missing_inputs)} are missing while {_ref(RAW_EVENTS, features_ds)} is there; build "
            f"that day first (`python -m features.build --ds {features_ds}`), then rerun this day"
        )

    validation = _check_validated(root, [ds], require_validation=require_validation)
    inputs = [_ref(RAW_EVENTS, ds), _ref(RAW_PINS, ds)]
    global_rates, rates_source = dict(DEFAULT_GLOBAL_RATES), "defaults"
    with connect(engine, root) as con:
        events = _events_part(root, ds, shard)
        _view(con, "events_all", events.files, EVENTS_SCHEMA)
        # An impression and its engagements have one user: a shard's labels are complete.
        con.execute(f"CREATE OR REPLACE TEMP VIEW events AS SELECT * FROM events_all WHERE {events.keeps}")
        _pins_view(con, root, ds)
        _check_unique_pins(con, ds, shard)
        sequence_digest: str | None = None
        for name, dataset, schema in feature_inputs:
            files = [] if _ref(dataset, features_ds) in missing_inputs else data_files(root, dataset, features_ds)
            if files:
                inputs.append(_ref(dataset, features_ds))
                if dataset == USER_SEQUENCE:
                    sequence_digest = _sequence_digest(root, features_ds, files)
            # A shard joins its own users' features only; every pin's (any user may see any pin).
            _view(con, name, files if dataset == PIN_WINDOW else shard_files(root, dataset, features_ds, shard, files), schema)
        if _ref(PIN_WINDOW, features_ds) in inputs:
            recorded = read_metadata(root, PIN_WINDOW, features_ds).get("global_rates")
            if recorded:
                global_rates = {k: float(recorded[k]) for k in DEFAULT_GLOBAL_RATES}
                rates_source = _ref(PIN_WINDOW, features_ds)
        if missing_inputs:
            log.warning("examples of ds=%s: no features of %s (cold start): %s", ds, features_ds, missing_inputs)
        con.execute(SMOOTHED_MACRO)
        keep_negative, keep_params = _keep_negative(negative_downsample, seed)
        params: dict[str, Any] = {"prior": prior_impressions, "unknown": UNKNOWN_ID} | {
            f"global_{k}": v for k, v in global_rates.items()
        }
        params |= keep_params
        params["seq_ds"] = dt.date.fromisoformat(features_ds)
        counts = _row(con, IMPRESSION_COUNTS_SQL)
        metadata = {
            "step": "examples",
            "dataset": EXAMPLES,
            "ds": ds,
            "features_ds": features_ds,
            "inputs": inputs,
            "missing_inputs": missing_inputs,
            "missing_days": [features_ds] if missing_inputs else [],
            "impressions": int(counts[0]),
            "impressions_unknown_pin": int(counts[1]),
            "negative_downsample": negative_downsample,
            "negative_weight": 1.0 / negative_downsample if negative_downsample > 0 else None,
            "seed": seed,
            "prior_impressions": prior_impressions,
            "global_rates": global_rates,
            "global_rates_source": rates_source,
            "dense_features": list(DENSE_FEATURES),
            # The reference of every example's sequence (seq_ds, seq_len): what a reader checks it resolves against.
            "sequence_ds": features_ds,
            "sequence_digest": sequence_digest,
            **validation,
        }
        summary = _write_query(
            con, EXAMPLES_SQL.replace(KEEP_NEGATIVE, keep_negative), params, root, EXAMPLES, ds, EXAMPLES_SCHEMA, metadata,
            sums=LABELS, sums_key="positives", shard=shard,
        )
    return {EXAMPLES: summary}


def build_day(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    *,
    window_days: int = DEFAULTS.window_days,
    sequence_length: int = DEFAULTS.sequence_length,
    prior_impressions: float = DEFAULTS.pin_prior_impressions,
    negative_downsample: float = DEFAULTS.negative_downsample,
    seed: int = DEFAULTS.negative_downsample_seed,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
) -> dict[str, Any]:
    """Run daily → window → sequences → examples for ``ds``; the summaries of every output, by dataset.

    ``recompute`` builds the window and the sequences from the raw events of the window's days instead of
    the daily aggregates and the previous day's sequences (the full recompute). ``require_validation=False``
    builds from raw partitions without a passed validation report (``skip_validation`` in the metadata).
    """
    return {
        **build_daily(root, ds, require_validation=require_validation, engine=engine),
        **build_window(root, ds, window_days, prior_impressions, recompute=recompute, require_validation=require_validation, engine=engine),
        **build_sequences(root, ds, sequence_length, window_days, recompute=recompute, require_validation=require_validation, engine=engine),
        **build_examples(root, ds, prior_impressions, negative_downsample, seed, require_validation=require_validation, engine=engine),
    }


# --- shards ---------------------------------------------------------------------------------------------

STEP_DATASETS: dict[str, tuple[str, ...]] = {
    "daily": (USER_DAILY, PIN_DAILY),
    "window": (USER_WINDOW, PIN_WINDOW),
    "sequences": (USER_SEQUENCE,),
    "examples": (EXAMPLES,),
}
# Metadata that differs from shard to shard (summed or dropped by the merge); every other key must agree.
_SUMMED_KEYS = ("rows", "events", "unknown_action_events", "impressions", "impressions_unknown_pin")
_PER_SHARD_KEYS = (*_SUMMED_KEYS, "positives", "content_digest", "shard")


def build_step(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    step: str,
    features: FeaturesConfig,
    *,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Build one step of ``ds`` with the ``features:`` settings (of one shard, if given): the summaries by dataset."""
    common: dict[str, Any] = {"require_validation": require_validation, "engine": engine, "shard": shard}
    if step == "daily":
        return build_daily(root, ds, **common)
    if step == "window":
        return build_window(root, ds, features.window_days, features.pin_prior_impressions, recompute=recompute, **common)
    if step == "sequences":
        return build_sequences(root, ds, features.sequence_length, features.window_days, recompute=recompute, **common)
    if step == "examples":
        return build_examples(
            root, ds, features.pin_prior_impressions, features.negative_downsample, features.negative_downsample_seed,
            **common,
        )
    raise ValueError(f"unknown feature step {step!r}: choose one of {', '.join(STEP_DATASETS)}")


def missing_shards(staging: str, step: str, count: int) -> list[int]:
    """The shards of a sharded build step whose outputs are not all in ``staging`` yet."""
    return [
        i for i in range(count)
        if not all(exists(join(shard_folder(staging, d, i), MARKER)) for d in STEP_DATASETS[step])
    ]


def merge_shards(root: str | os.PathLike[str], ds: str | dt.date, step: str, staging: str, count: int) -> dict[str, Any]:
    """Publish the partitions of ``step`` for ``ds`` from the ``count`` shards in ``staging``; their summaries.

    Cheap (no data is read): each partition is published whole (``core.storage.publish``) with one file per shard
    (linked locally, copied server-side on an object store) and the shards' metadata merged: ``rows`` and
    ``positives`` summed, ``shards`` recorded. Every other metadata key must be equal in every shard (the same
    inputs, parameters and validation fingerprints): shards built from different data are never merged (DataError).
    A shard's missing output is an InfraError (a retry builds it). The staging folder is removed afterwards.
    """
    ds = ds_str(ds)
    missing = missing_shards(staging, step, count)
    if missing:
        raise InfraError(f"{step} of ds={ds}: shard(s) {missing} have no output in {staging}: a retry builds them")
    summary: dict[str, Any] = {}
    for dataset in STEP_DATASETS[step]:
        # Each shard's published version (on an object store the version folder its marker names).
        folders = [resolve(shard_folder(staging, dataset, i)) for i in range(count)]
        metas = [dict(read_json(join(folder, METADATA_FILE))) for folder in folders]
        merged = {k: v for k, v in metas[0].items() if k not in _PER_SHARD_KEYS}
        for i, meta in enumerate(metas[1:], start=1):
            other = {k: v for k, v in meta.items() if k not in _PER_SHARD_KEYS}
            if other != merged:
                differ = sorted(k for k in set(other) | set(merged) if other.get(k) != merged.get(k))
                raise DataError(
                    f"{dataset} ds={ds}: shard {i} was built from other inputs or settings than shard 0 ({', '.join(differ)} "
                    f"differ; an input was rebuilt during the build?): rerun the step, which rebuilds every shard"
                )
        for key in _SUMMED_KEYS:
            if key in metas[0]:
                merged[key] = sum(int(m[key]) for m in metas)
        if "positives" in metas[0]:
            merged["positives"] = {k: sum(int(m["positives"][k]) for m in metas) for k in metas[0]["positives"]}
        if all("content_digest" in m for m in metas):  # else each examples shard of the next day digests every file
            merged["content_digest"] = combined_digest([m["content_digest"] for m in metas])
        merged["shards"] = count
        # File part-i holds shard i's rows: the next day's shard i reads only its files (``shard_part``).
        merged["hash_buckets"] = hash_layout(DATASET_KEYS[dataset], count)
        with write_partition(root, dataset, ds) as out:
            for i, folder in enumerate(folders):
                copy_file(join(folder, shard_file(i)), join(out, shard_file(i)))
            write_json(join(out, METADATA_FILE), merged)
        summary[dataset] = merged
    remove_tree(staging)
    return summary


# --- CLI ------------------------------------------------------------------------------------------------


def _parser(defaults: FeaturesConfig) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m features.build",
        description="Build the feature partitions of one day (daily aggregates, windows, sequences, examples): as "
        "--spec says (a BUILD.json, features.spec.BuildSpec, as the feature operator writes it), or as the flags "
        "say, which build the same spec. Defaults come from the features: section of the platform configuration "
        "(python -m core.config).",
    )
    parser.add_argument("--spec", default="",
                        help="the build's spec, BUILD.json (a local path or URL); the settings flags may not be given too")
    # Settings flags default to None: given with --spec, they are refused, never silently ignored.
    parser.add_argument("--root", help="storage root: a local folder, a file:// or an s3:// URL")
    parser.add_argument("--ds", help="the partition day, YYYY-MM-DD")
    parser.add_argument("--step", choices=("daily", "window", "sequences", "examples", "all"),
                        help="which output to build (default: all, in order)")
    parser.add_argument("--window-days", type=int,
                        help=f"days in the window features and sequences (default: {defaults.window_days})")
    parser.add_argument("--sequence-length", type=int,
                        help=f"engagements kept per user (default: {defaults.sequence_length})")
    parser.add_argument("--prior-impressions", type=float, help="pseudo-impressions at the global rate that smooth "
                        f"each pin's rates (default: {defaults.pin_prior_impressions})")
    parser.add_argument("--negative-downsample", type=float, help="probability of keeping an example without a "
                        f"positive label, in (0, 1] (default: {defaults.negative_downsample})")
    parser.add_argument("--seed", type=int,
                        help=f"seed of the negative downsampling hash (default: {defaults.negative_downsample_seed})")
    parser.add_argument(
        "--recompute",
        action="store_true", default=None,
        help="build the window and the sequences from the raw events of the window's days (full recompute)",
    )
    parser.add_argument(
        "--skip-validation",
        action="store_true", default=None,
        help="build even from raw partitions without a passed validation report for their current contents "
        "(python -m features.validate); recorded as skip_validation in the outputs' metadata. For experts",
    )
    parser.add_argument(
        "--shards", type=int,
        help="split the step into this many shards by user-id / pin-id hash (one --step, not all); each shard "
        "writes under --staging, and --merge publishes the day from them (default: 1, unsharded)",
    )
    parser.add_argument("--run-shards", default="",
                        help="the shards to build, e.g. 0,3,5-7 (default: all); in an array job the index picks one")
    parser.add_argument("--staging", help="the sharded build's staging folder (a local path or URL)")
    parser.add_argument("--merge", action="store_true", default=None,
                        help="publish the step's partitions from the shards in --staging")
    parser.add_argument("--threads", type=int, help=f"DuckDB threads (default: {defaults.duckdb_threads})")
    parser.add_argument("--memory-limit", help=f"DuckDB memory limit, e.g. 4GB (default: {defaults.duckdb_memory_limit})")
    parser.add_argument("--temp-directory", help="parent folder for DuckDB spill files (default: "
                        f"{defaults.duckdb_temp_directory or 'the system temporary folder'})")
    return parser


# The settings flags and the spec's fields they set.
_FLAGS = {"root": "root", "ds": "ds", "step": "step", "window_days": "window_days", "sequence_length": "sequence_length",
          "prior_impressions": "pin_prior_impressions", "negative_downsample": "negative_downsample",
          "seed": "negative_downsample_seed", "recompute": "recompute", "skip_validation": "skip_validation",
          "shards": "shards", "staging": "staging", "merge": "merge", "threads": "duckdb_threads",
          "memory_limit": "duckdb_memory_limit", "temp_directory": "duckdb_temp_directory"}


def spec_of(args: argparse.Namespace, defaults: FeaturesConfig) -> BuildSpec:
    """The build's spec: read from ``--spec``, or built from the flags over the configuration's defaults."""
    from core.failures import ConfigError
    from features.spec import FEATURE_FIELDS, BuildSpec

    given = {field: getattr(args, flag) for flag, field in _FLAGS.items() if getattr(args, flag) is not None}
    if args.spec:
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in _FLAGS if getattr(args, f) is not None)
            raise ConfigError(f"--spec {args.spec} and {flags}: give the spec or the flags, not both (edit the spec)")
        return BuildSpec.read(args.spec)
    missing = [f"--{name}" for name in ("root", "ds") if name not in given]
    if missing:
        raise ConfigError(f"give --spec, or {' and '.join(missing)} (python -m features.build --help)")
    return BuildSpec.checked("the command line", **{**{f: getattr(defaults, f) for f in FEATURE_FIELDS}, **given})


def run(spec: BuildSpec, run_shards: str = "") -> dict[str, Any]:
    engine = DuckDBSettings(threads=spec.duckdb_threads, memory_limit=spec.duckdb_memory_limit,
                            temp_directory=spec.duckdb_temp_directory or None)
    require = not spec.skip_validation
    if spec.skip_validation:
        log.warning("skip_validation: building %s from raw partitions that may not have passed validation", spec.ds)
    check_root(spec.root)
    if spec.shards > 1 or spec.merge:
        return _run_sharded(spec, engine, require, run_shards)
    if spec.step != "all":
        return build_step(spec.root, spec.ds, spec.step, spec.features(), recompute=spec.recompute,
                          require_validation=require, engine=engine)
    return build_day(
        spec.root,
        spec.ds,
        window_days=spec.window_days,
        sequence_length=spec.sequence_length,
        prior_impressions=spec.pin_prior_impressions,
        negative_downsample=spec.negative_downsample,
        seed=spec.negative_downsample_seed,
        recompute=spec.recompute,
        require_validation=require, engine=engine,
    )


def _run_sharded(spec: BuildSpec, engine: DuckDBSettings, require: bool, run_shards: str) -> dict[str, Any]:
    from core.arrays import parse_shards, shards_of_this_process

    if spec.merge:
        return merge_shards(spec.root, spec.ds, spec.step, spec.staging, spec.shards)
    features = spec.features()
    summary: dict[str, Any] = {}
    for index in shards_of_this_process(parse_shards(run_shards) or list(range(spec.shards))):
        shard = Shard(index, spec.shards, spec.staging)
        log.info("building %s of ds=%s, shard %d of %d", spec.step, spec.ds, index, spec.shards)
        built = build_step(spec.root, spec.ds, spec.step, features, recompute=spec.recompute, require_validation=require,
                           engine=engine, shard=shard)
        summary[f"shard-{index:05d}"] = built
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from core import config

    spec: BuildSpec | None = None
    try:
        defaults = config.load().features
        args = _parser(defaults).parse_args(argv)
        spec = spec_of(args, defaults)
        summary = run(spec, args.run_shards)
    except PinflowError as exc:
        print(f"features.build: {exc.failure_class.value} error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # a bad setting (the typed settings' or a step's own check): fix the command
        print(f"features.build: USER error: {exc}", file=sys.stderr)
        return int(ExitCode.USER)
    except Exception as exc:
        if classify(exc) is FailureClass.USER:
            raise  # a bug: the traceback says where (exit 1, USER)
        # Nothing was published (a partition appears only whole); the exit code tells the operator to retry or stop.
        log.error("failed", exc_info=exc)
        hint = ""
        if disk_full(exc) and spec is not None:
            hint = (f" (the disk is full: free space under the storage root {spec.root} or in DuckDB's temp directory "
                    f"{spec.duckdb_temp_directory or tempfile.gettempdir()}; the task's retries build it again)")
        print(f"features.build: {classify(exc).value} error: {exc}{hint}", file=sys.stderr)
        return int(exit_code_for(exc))
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
