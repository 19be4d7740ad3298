"""The daily step: ``features/user_daily`` and ``features/pin_daily`` of one day, from that day's events only.

Its SQL (``USER_DAILY_SQL``, ``PIN_DAILY_SQL``) also computes the aggregates of a window's day whose daily
partitions are missing (``features.steps.window``).
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from core.contracts import (
    ACTIONS,
    COUNT_COLUMNS,
    EVENTS_SCHEMA,
    PIN_DAILY,
    PIN_DAILY_SCHEMA,
    RAW_EVENTS,
    RAW_PINS,
    USER_DAILY,
    USER_DAILY_SCHEMA,
)
from core.storage import ds_str
from features.bucketed_events import events_part
from features.sharding import Shard
from features.step_io import (
    UNKNOWN_ID,
    DuckDBSettings,
    check_unique_pins,
    check_validated,
    connect,
    create_view,
    events_hint,
    indent,
    one_row,
    partition_ref,
    pins_hint,
    pins_view,
    require_input,
    sql_list,
    write_query,
)

_ACTION_OF_COUNT = dict(zip(COUNT_COLUMNS, ACTIONS, strict=True))  # "clicks" -> "click"
_DAILY_COUNTS = indent([f"count(*) FILTER (WHERE action = '{a}') AS {c}" for c, a in _ACTION_OF_COUNT.items()], 7)

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

# The counts whose totals over every pin give the window's global rates (``features.steps.window``).
PIN_TOTAL_COLUMNS = ("impressions", "clicks", "repins", "hides")

PIN_DAILY_SQL = f"""
SELECT pin_id,
       {_DAILY_COUNTS},
       count(DISTINCT user_id) AS distinct_users
FROM events
GROUP BY pin_id
ORDER BY pin_id
"""


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
    require_input(root, RAW_EVENTS, ds, events_hint(ds))
    require_input(root, RAW_PINS, ds, pins_hint(ds))  # the day's snapshot (or increment) has landed
    base: dict[str, Any] = {
        "step": "daily",
        "ds": ds,
        "inputs": [partition_ref(RAW_EVENTS, ds), partition_ref(RAW_PINS, ds)],
        "missing_days": [],
        **check_validated(root, [ds], require_validation=require_validation),
    }
    summary: dict[str, Any] = {}
    counts = (
        "SELECT count(*), count(*) FILTER (WHERE action IS NULL OR action NOT IN "
        f"({sql_list(ACTIONS)})) FROM events"
    )
    with connect(engine, root) as con:
        pins_view(con, root, ds)
        check_unique_pins(con, ds, shard)
        for dataset, sql, schema in ((USER_DAILY, USER_DAILY_SQL, USER_DAILY_SCHEMA), (PIN_DAILY, PIN_DAILY_SQL, PIN_DAILY_SCHEMA)):
            key = "user_id" if dataset == USER_DAILY else "pin_id"
            # A shard reads its buckets of the day (by user for users, by pin for pins) and counts its own events:
            # the merge sums the counts (each event is in one shard of each side).
            part = events_part(root, ds, shard, key)
            create_view(con, "events_all", part.files, EVENTS_SCHEMA)
            con.execute(f"CREATE OR REPLACE TEMP VIEW events AS SELECT * FROM events_all WHERE {part.keeps}")
            if shard is not None or dataset == USER_DAILY:
                events_rows, unknown = one_row(con, counts)
                base["events"] = int(events_rows)
                base["unknown_action_events"] = int(unknown)
            summary[dataset] = write_query(
                con, sql, {"unknown": UNKNOWN_ID} if dataset == USER_DAILY else None,
                root, dataset, ds, schema, {**base, "dataset": dataset}, shard=shard,
                # The pin side's totals: a window shard adds them to the previous window's instead of reading every pin.
                sums=PIN_TOTAL_COLUMNS if dataset == PIN_DAILY else (), last_query=dataset == PIN_DAILY,
            )
    return summary
