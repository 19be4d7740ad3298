"""The sequences step: ``features/user_sequence``, each user's last N engagements in the window, as of a day.

Incremental (the previous day's sequences merged with the day's engagements) or a full recompute from the raw
events of the window's days; both give the same lists (exactness).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Sequence
from typing import Any

import duckdb

from core.contracts import (
    ACTIONS,
    ENGAGEMENTS,
    RAW_EVENTS,
    RAW_PINS,
    USER_SEQUENCE,
    USER_SEQUENCE_SCHEMA,
    SequenceDigest,
)
from core.storage import day_range, ds_str, is_complete, read_metadata, shift_ds
from features.bucketed_events import events_part
from features.sharding import Shard, shard_part
from features.step_io import (
    DEFAULTS,
    UNKNOWN_ID,
    DuckDBSettings,
    check_positive,
    check_unique_pins,
    check_validated,
    connect,
    create_view,
    day_start,
    events_hint,
    has_raw,
    indent,
    partition_ref,
    pins_hint,
    pins_source,
    pins_view,
    quoted_paths,
    require_input,
    sql_list,
    write_query,
)

log = logging.getLogger(__name__)


_ACTION_INDEX = " ".join(f"WHEN '{a}' THEN {i}" for i, a in enumerate(ACTIONS))


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
WHERE e.action IN ({sql_list(ENGAGEMENTS)}) AND e.ts >= $window_start AND e.ts < $window_end AND {{keeps}}
"""

_SEQ_LISTS = ("seq_pin_ids", "seq_actions", "seq_categories", "seq_ts")
_SEQ_FIELDS = ("pin_id", "action_idx", "category", "ts")
_SEQ_TYPES = ("BIGINT", "INTEGER", "INTEGER", "TIMESTAMPTZ")
_MERGED_LISTS = indent(
    [
        f"list_concat(coalesce(list_transform(l.items, lambda x: x.{f}), []::{t}[]), coalesce(p.{s}, []::{t}[])) AS {s}"
        for s, f, t in zip(_SEQ_LISTS, _SEQ_FIELDS, _SEQ_TYPES, strict=True)
    ],
    9,
)
_KEPT_LISTS = indent([f"{s}[1:n] AS {s}" for s in _SEQ_LISTS], 7)

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
    parts = {day: events_part(root, day, shard) for day in days}
    return "\nUNION ALL\n".join(
        ENGAGEMENTS_OF_DAY_SQL.format(
            events=quoted_paths(part.files), pins=pins_source(con, root, day), keeps=part.keeps
        )
        for day, part in parts.items()
    )


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
    check_positive("sequence_length", sequence_length, "--sequence-length")
    check_positive("window_days", window_days, "--window-days")
    window_start = shift_ds(ds, -(window_days - 1))
    days = day_range(window_start, ds)
    previous_ds = shift_ds(ds, -1)
    require_input(root, RAW_PINS, ds, pins_hint(ds))  # the day's snapshot (or increment) has landed
    require_input(root, RAW_EVENTS, ds, events_hint(ds))

    params = {"sequence_length": sequence_length, "window_days": window_days}
    mode, reason = "full", f"{partition_ref(USER_SEQUENCE, previous_ds)} is missing"
    previous_meta: dict[str, Any] = {}
    if recompute:
        reason = "recompute requested"
    elif is_complete(root, USER_SEQUENCE, previous_ds):
        previous_meta = read_metadata(root, USER_SEQUENCE, previous_ds)
        previous_params = {k: previous_meta.get(k) for k in params}
        if previous_params == params:
            mode, reason = (
                "incremental",
                f"merged {partition_ref(USER_SEQUENCE, previous_ds)} with {partition_ref(RAW_EVENTS, ds)}",
            )
        else:
            reason = f"{partition_ref(USER_SEQUENCE, previous_ds)} was built with {previous_params}, not {params}"

    with connect(engine, root) as con:
        pins_view(con, root, ds)
        check_unique_pins(con, ds, shard)
        if mode == "incremental":
            previous = shard_part(root, USER_SEQUENCE, previous_ds, shard)
            create_view(con, "previous_all", previous.files, USER_SEQUENCE_SCHEMA)
            con.execute(f"CREATE OR REPLACE TEMP VIEW previous_sequence AS SELECT * FROM previous_all WHERE {previous.keeps}")
            validation = check_validated(root, [ds], require_validation=require_validation)
            engagements = _engagements_sql(con, root, [ds], shard)
            inputs = [partition_ref(USER_SEQUENCE, previous_ds), partition_ref(RAW_EVENTS, ds), partition_ref(RAW_PINS, ds)]
            carried = previous_meta.get("missing_days", [])
            missing_days = sorted(d for d in carried if d >= window_start)
        else:
            # A day needs its events and its pins snapshot (the categories of its actions).
            present = [d for d in days[:-1] if has_raw(root, d)]
            validation = check_validated(root, [*present, ds], require_validation=require_validation)
            create_view(con, "previous_sequence", [], USER_SEQUENCE_SCHEMA)
            engagements = _engagements_sql(con, root, [*present, ds], shard)
            inputs = [partition_ref(raw, d) for d in [*present, ds] for raw in (RAW_EVENTS, RAW_PINS)]
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
            "window_start": day_start(window_start),
            "window_end": day_start(shift_ds(ds, 1)),
            "sequence_length": sequence_length,
            "unknown": UNKNOWN_ID,
        }
        sql = USER_SEQUENCE_SQL.format(engagements=engagements)
        summary = write_query(
            con, sql, sql_params, root, USER_SEQUENCE, ds, USER_SEQUENCE_SCHEMA, metadata, digest=SequenceDigest(),
            shard=shard, last_query=True,
        )
    return {USER_SEQUENCE: summary}
