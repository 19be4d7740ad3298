"""The raw events of a day bucketed by user and by pin hash, so that each shard of a build reads only its part.

Validation writes them when the build is sharded (``write_event_buckets``); the steps read the raw events of a
shard through ``events_part``, which falls back to the raw files when the buckets are missing or stale.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from typing import Any

from core.contracts import ACTIONS, COUNT_COLUMNS, EVENTS_BY_PIN, EVENTS_BY_USER, EVENTS_SCHEMA, RAW_EVENTS
from core.storage import (
    METADATA_FILE,
    data_files,
    ds_str,
    is_complete,
    join,
    open_output,
    partition,
    read_metadata,
    write_json,
    write_partition,
)
from features.sharding import Shard, ShardPart, hash_layout, shard_file, shard_part
from features.step_io import (
    DEFAULTS,
    ROW_GROUP_ROWS,
    DuckDBSettings,
    connect,
    create_view,
    events_hint,
    input_versions,
    one_row,
    parquet_writer,
    partition_ref,
    query_table,
    require_input,
    sql_list,
)

log = logging.getLogger(__name__)


# The day's events by action, over every event: what pin_daily's rows of the day sum to once merged (its ``sums``;
# each of its rows counts one pin's events by action), and the events outside the contract's actions. A shard of the
# DAG's first job reads them to build the day's window with the other shards' pins in its global rates
# (``features.steps.window``), before pin_daily is merged.
DAY_COUNTS_SQL = "SELECT " + ", ".join(
    [f"count(*) FILTER (WHERE action = '{a}')" for a in ACTIONS]
    + ["count(*)", f"count(*) FILTER (WHERE action IS NULL OR action NOT IN ({sql_list(ACTIONS)}))"]
) + " FROM events_all"


def stale_buckets(root: str | os.PathLike[str], dataset: str, day: str) -> str | None:
    """Why the bucketed copy ``dataset`` of ``day``'s events cannot stand for the raw partition as it is now (None
    when it can): missing, or made from another version of it. Both its publish stamp and its content fingerprint
    (``features.validation.report.content_fingerprint``: names, sizes, write stamps and footers of its files) must be
    those the copy recorded: a producer that re-lands a day with the same (or an empty) ``_SUCCESS`` still changes the
    fingerprint."""
    from features.validation.report import content_fingerprint

    if not is_complete(root, dataset, day):
        return f"{partition_ref(dataset, day)} is missing (validation buckets the events for sharded builds)"
    meta = read_metadata(root, dataset, day)
    ref = partition_ref(RAW_EVENTS, day)
    current = input_versions(root, [ref])[ref]
    if current is None or meta.get("source_version") != current or (
            meta.get("source_fingerprint") != content_fingerprint(partition(root, RAW_EVENTS, day))):
        return f"{partition_ref(dataset, day)} was made from another version of {ref} (validate it again to rebucket it)"
    return None


def day_counts(root: str | os.PathLike[str], day: str) -> tuple[dict[str, Any] | None, str]:
    """The counts of ``day``'s events recorded when they were bucketed (``sums`` by count column, ``events``,
    ``unknown_action_events``) if the buckets are of the raw partition as it is now, and ''; else None and why."""
    stale = stale_buckets(root, EVENTS_BY_PIN, day)
    if stale:
        return None, stale
    meta = read_metadata(root, EVENTS_BY_PIN, day)
    sums = meta.get("sums")
    if not isinstance(sums, dict):
        return None, f"{partition_ref(EVENTS_BY_PIN, day)} records no counts (bucketed before they were recorded)"
    return {"sums": sums, "events": meta.get("events"), "unknown_action_events": meta.get("unknown_action_events")}, ""


# The columns of each bucketed copy of the events: the pin side only feeds pin_daily.
EVENT_BUCKETS: dict[str, tuple[str, str]] = {
    EVENTS_BY_USER: ("user_id", "*"),
    EVENTS_BY_PIN: ("pin_id", "pin_id, user_id, action"),
}


def events_part(root: str | os.PathLike[str], day: str, shard: Shard | None, key: str = "user_id") -> ShardPart:
    """What a shard reads of the raw events of ``day``: its buckets of the bucketed copy by ``key`` when that copy
    was made from the raw partition as it is now (its publish stamp), else the raw files, filtered."""
    raw = data_files(root, RAW_EVENTS, day)
    if shard is None:
        return ShardPart(raw, "TRUE")
    dataset = EVENTS_BY_USER if key == "user_id" else EVENTS_BY_PIN
    if stale_buckets(root, dataset, day):
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
    from features.validation.report import content_fingerprint

    events = require_input(root, RAW_EVENTS, ds, events_hint(ds))
    version = input_versions(root, [partition_ref(RAW_EVENTS, ds)])[partition_ref(RAW_EVENTS, ds)]
    fingerprint = content_fingerprint(partition(root, RAW_EVENTS, ds))  # taken before the events are read
    summary: dict[str, Any] = {}
    with connect(engine, root) as con:
        create_view(con, "events_all", events, EVENTS_SCHEMA)
        *by_action, total, unknown = (int(v) for v in one_row(con, DAY_COUNTS_SQL))
        counts = {"sums": dict(zip(COUNT_COLUMNS, by_action, strict=True)), "events": total,
                  "unknown_action_events": unknown}
        for dataset, (key, columns) in EVENT_BUCKETS.items():
            # Sorted by bucket, so that each bucket's scan of the temp table skips the others' row groups.
            con.execute(
                f"CREATE OR REPLACE TEMP TABLE bucketed AS SELECT hash({key}) % {count} AS bucket, {columns} "
                "FROM events_all ORDER BY bucket"
            )
            rows = 0
            with write_partition(root, dataset, ds) as out:
                for bucket in range(count):
                    table = query_table(con, "SELECT * EXCLUDE (bucket) FROM bucketed WHERE bucket = $b", {"b": bucket})
                    rows += table.num_rows
                    with (
                        open_output(join(out, shard_file(bucket))) as sink,
                        parquet_writer(sink, table.schema, bucketed=True) as writer,
                    ):
                        writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
                meta = {
                    "dataset": dataset, "ds": ds, "source": partition_ref(RAW_EVENTS, ds), "source_version": version,
                    "source_fingerprint": fingerprint,
                    "rows": rows, "hash_buckets": hash_layout(key, count), **counts,
                }
                write_json(join(out, METADATA_FILE), meta)
            summary[dataset] = meta
        con.execute("DROP TABLE IF EXISTS bucketed")
    if (input_versions(root, [partition_ref(RAW_EVENTS, ds)])[partition_ref(RAW_EVENTS, ds)] != version
            or content_fingerprint(partition(root, RAW_EVENTS, ds)) != fingerprint):
        log.warning("%s was republished while it was bucketed: shards read it whole until it is bucketed again", partition_ref(RAW_EVENTS, ds))
    return summary
