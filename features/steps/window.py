"""The window step: ``features/user_window`` and ``features/pin_window`` as of the end of a day.

Signed sums of daily aggregates: incremental (the previous window + the new day - the day that leaves) when it can
be, else the full sum of the window's days; pin rates smoothed towards the window's global rates
(``SMOOTHED_MACRO``, also used by the examples for pins without features).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb

from core.contracts import (
    COUNT_COLUMNS,
    EVENTS_SCHEMA,
    PIN_DAILY,
    PIN_DAILY_SCHEMA,
    PIN_WINDOW,
    PIN_WINDOW_SCHEMA,
    RAW_EVENTS,
    RAW_PINS,
    USER_DAILY,
    USER_DAILY_SCHEMA,
    USER_WINDOW,
    USER_WINDOW_SCHEMA,
)
from core.storage import (
    MARKER,
    data_files,
    day_range,
    day_spans,
    ds_str,
    is_complete,
    join,
    partition,
    read_metadata,
    read_text,
    shift_ds,
)
from features.sharding import Shard, ShardPart, shard_keeps, shard_part
from features.step_io import (
    DEFAULTS,
    UNKNOWN_ID,
    DuckDBSettings,
    MissingInputError,
    check_positive,
    check_unique_pins,
    check_validated,
    connect,
    create_view,
    has_raw,
    indent,
    one_row,
    partition_ref,
    pins_view,
    quoted_paths,
    write_query,
)
from features.steps.daily import PIN_DAILY_SQL, PIN_TOTAL_COLUMNS, USER_DAILY_SQL

log = logging.getLogger(__name__)


# Global rates used as the prior when no pin_window metadata is there to provide them (cold start).
DEFAULT_GLOBAL_RATES: dict[str, float] = {"ctr": 0.0, "repin_rate": 0.0, "hide_rate": 0.0}


# Window features: signed sums of rows shaped like the daily aggregates. Input views: user_parts / pin_parts
# (the count columns, the categories for users, and ``part_sign``). The full sum: every day of the window,
# sign +1. The incremental one: the previous window (+1), the new day (+1) and the day that leaves (-1);
# there a category or a pin whose sums all reach zero is dropped (DROP_ZERO), which equals the full sum
# because every event counts in a category and in a pin count (no action outside ACTIONS: the incremental
# path is taken only when no day of the window had one). Integer sums only, so the result does not depend on
# how the days were gathered (exactness).
_SIGNED_SUMS = indent([f"sum(part_sign * {c})::BIGINT AS {c}" for c in COUNT_COLUMNS], 9)
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
# A shard's pin_sums hold its own pins only: its totals are the signed sums of every pin's parts (the same integers),
# when the parts record no totals of their own (``_recorded_totals``).
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


# ``daily_versions`` of ds in the window a shard builds from its staged daily aggregates: the merge that publishes them
# puts their publish stamps there (``features.build.merge_shards``).
STAGED_DAY_VERSION = "staged"


@dataclass(frozen=True)
class StagedDay:
    """The daily aggregates of ``ds`` that one shard of the DAG's first job has just built, not merged yet: its files
    (``user_daily``, ``pin_daily``) and the counts of the day's events over every shard (``counts``,
    ``features.bucketed_events.day_counts``). From them the shard builds its part of the day's window in the same job
    (``features.build``), when the window can be incremental; the merge publishes both."""

    user_daily: str
    pin_daily: str
    counts: dict[str, Any]


def _recorded_totals(root: str | os.PathLike[str], signed: Sequence[tuple[str, str, int]],
                     staged: StagedDay | None = None) -> dict[str, int] | None:
    """The pin totals of an incremental window from its parts' metadata, no data read: the previous pin_window's
    ``totals`` plus the day's pin_daily ``sums`` minus the leaving day's (the same integers as summing every pin's
    rows, as each part's recorded totals are the sums of its rows); None when a part records none (built before).
    With a ``staged`` day, the day's sums are the counts of its events recorded by the bucketing (the same integers)."""
    totals = dict.fromkeys(PIN_TOTAL_COLUMNS, 0)
    for dataset, day, sign in signed:
        if staged is not None and dataset == PIN_DAILY and sign > 0:
            recorded = staged.counts.get("sums")
        else:
            recorded = read_metadata(root, dataset, day).get("totals" if dataset == PIN_WINDOW else "sums")
        if not isinstance(recorded, dict) or any(not isinstance(recorded.get(c), int) for c in PIN_TOTAL_COLUMNS):
            return None
        for column in PIN_TOTAL_COLUMNS:
            totals[column] += sign * recorded[column]
    return totals


def daily_version(root: str | os.PathLike[str], day: str) -> str | None:
    """The publish stamps (``_SUCCESS`` contents) of ``day``'s user_daily and pin_daily; None if one is incomplete.

    A rebuild of either partition changes it: an incremental window subtracts a day only if its aggregates
    are still those the previous window added.
    """
    try:
        return "|".join(read_text(join(partition(root, d, day), MARKER)) for d in (USER_DAILY, PIN_DAILY))
    except FileNotFoundError:
        return None


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
        elif has_raw(root, day):
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
            create_view(con, f"{name}_stored", files, schema)
            parts.append(f"SELECT * FROM {name}_stored")
        for i, day in enumerate(computed):
            create_view(con, "events", data_files(root, RAW_EVENTS, day), EVENTS_SCHEMA)
            pins_view(con, root, day)
            check_unique_pins(con, day)
            con.execute(f"CREATE OR REPLACE TEMP TABLE {name}_raw_{i} AS {sql}", {"unknown": UNKNOWN_ID} if name == "user_daily" else None)
            parts.append(f"SELECT * FROM {name}_raw_{i}")
        if parts:
            con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS " + " UNION ALL BY NAME ".join(parts))
        else:
            create_view(con, name, [], schema)


def _incremental_window(
    root: str | os.PathLike[str], ds: str, days: Sequence[str], window_days: int, staged: StagedDay | None = None
) -> tuple[dict[str, Any] | None, str]:
    """The plan of an incremental window of ``ds`` and why; None (and why not) when it must be a full sum.

    Incremental when the windows of ``ds-1`` are complete, were built with the same ``window_days`` from
    daily partitions only, and every day they summed is still the same (the publish stamps of its daily
    partitions, ``daily_versions``), every day they lacked still has no data, ``ds`` has its daily partitions,
    and no day of the window has an action outside the contract (``unknown_action_days``).
    """
    previous_ds = shift_ds(ds, -1)
    # Both outputs' mode_reason: it names the two windows, not the user one alone.
    previous = f"the windows of {previous_ds}"
    absent = [partition_ref(d, previous_ds) for d in (USER_WINDOW, PIN_WINDOW) if not is_complete(root, d, previous_ds)]
    if absent:
        return None, f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing"
    meta = read_metadata(root, USER_WINDOW, previous_ds)
    versions = meta.get("daily_versions")
    if meta.get("window_days") != window_days:
        return None, f"{previous} were built with window_days={meta.get('window_days')}, not {window_days}"
    if not isinstance(versions, dict) or read_metadata(root, PIN_WINDOW, previous_ds).get("daily_versions") != versions:
        return None, f"{partition_ref(USER_WINDOW, previous_ds)} and {partition_ref(PIN_WINDOW, previous_ds)} record no common daily_versions"
    if meta.get("computed_from_raw"):
        return None, f"{previous} computed {', '.join(meta['computed_from_raw'])} from raw events"
    if meta.get("unknown_action_days") != []:
        return None, f"{previous} sum days with actions outside the contract: {meta.get('unknown_action_days')}"
    if staged is None:
        version = daily_version(root, ds)
        if version is None:
            return None, f"the daily aggregates of {ds} are missing"
        if read_metadata(root, USER_DAILY, ds).get("unknown_action_events") != 0:
            return None, f"{partition_ref(USER_DAILY, ds)} counts events with actions outside the contract"
    else:
        version = STAGED_DAY_VERSION
        if staged.counts.get("unknown_action_events") != 0:
            return None, f"the events of {ds} have actions outside the contract"
    leaving = shift_ds(ds, -window_days)
    for day in [leaving, *days[:-1]]:
        recorded = versions.get(day)
        if recorded is not None and daily_version(root, day) != recorded:
            return None, f"the daily aggregates of {day} were rebuilt since {previous} were built"
        if recorded is None and day != leaving and (daily_version(root, day) is not None or has_raw(root, day)):
            return None, f"{day} was missing from {previous} and has data now"
    plan = {
        "previous_ds": previous_ds,
        "leaving": leaving if leaving in versions else None,
        "daily_versions": {d: v for d, v in versions.items() if d >= days[0]} | {ds: version},
        "missing_days": sorted(d for d in meta.get("missing_days", []) if d >= days[0]),
    }
    reason = f"{previous} + {ds}" + (f" - {leaving}" if plan["leaving"] else f" ({leaving} was missing)")
    return plan, reason


def _signed(window: str, daily: str, ds: str, plan: dict[str, Any]) -> list[tuple[str, str, int]]:
    """The parts of an incremental window and their signs: the previous window, the day, the day that leaves."""
    signed = [(window, plan["previous_ds"], 1), (daily, ds, 1)]
    if plan["leaving"]:
        signed.append((daily, plan["leaving"], -1))
    return signed


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
    staged: StagedDay | None = None,
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

    A shard given its ``staged`` daily aggregates of ``ds`` (:class:`StagedDay`) builds its part of the window from
    them, and only incrementally with recorded pin totals: otherwise it builds nothing (an empty summary, the reason
    logged) and the window is left to a job of its own, once the day's aggregates are merged.
    """
    ds = ds_str(ds)
    check_positive("window_days", window_days, "--window-days")
    check_positive("prior_impressions", prior_impressions, "--prior-impressions", allow_zero=True)
    days = day_range(shift_ds(ds, -(window_days - 1)), ds)
    params = {"window_days": window_days, "prior_impressions": prior_impressions}
    plan, reason = (None, "recompute requested") if recompute else _incremental_window(root, ds, days, window_days, staged)
    recorded_totals: dict[str, int] | None = None
    if staged is not None:
        if plan is None:
            log.info("window of ds=%s: left to the window job, as it is not incremental (%s)", ds, reason)
            return {}
        recorded_totals = _recorded_totals(root, _signed(PIN_WINDOW, PIN_DAILY, ds, plan), staged)
        if recorded_totals is None:
            log.info("window of ds=%s: left to the window job: a part records no pin totals (built before they were)", ds)
            return {}
    inputs: dict[str, list[str]] = {}
    with connect(engine, root) as con:
        if plan is not None:
            computed: list[str] = []
            stored, missing = sorted(plan["daily_versions"]), plan["missing_days"]
            validation = check_validated(root, [], require_validation=require_validation)  # reads no raw data
            daily_versions, unknown_action_days = plan["daily_versions"], []
            for name, window, daily in (("user", USER_WINDOW, USER_DAILY), ("pin", PIN_WINDOW, PIN_DAILY)):
                signed = _signed(window, daily, ds, plan)
                views = [(f"{name}_parts", shard)]
                if name == "pin" and shard is not None:
                    # A shard's pin_sums hold its own pins: the totals come from the recorded ones (a staged day's: read
                    # above), else every pin's parts.
                    if recorded_totals is None:
                        recorded_totals = _recorded_totals(root, signed)
                    if recorded_totals is None:
                        views.append(("pin_parts_all", None))
                for view, of_shard in views:
                    parts = [
                        (ShardPart([staged.user_daily if name == "user" else staged.pin_daily], "TRUE")
                         if staged is not None and day == ds and dataset == daily
                         else shard_part(root, dataset, day, of_shard), sign)
                        for dataset, day, sign in signed
                    ]
                    selects = [
                        f"SELECT {_PART_COLUMNS[name]}, {sign} AS part_sign "
                        f"FROM read_parquet([{quoted_paths(part.files)}], hive_partitioning = false) WHERE {part.keeps}"
                        for part, sign in parts
                    ]
                    # A shard reads only the files of its users / pins (``shard_part``).
                    con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS " + "\nUNION ALL\n".join(selects))
                # The staged day is not an input partition yet: the merge that publishes it adds it.
                inputs[name] = [partition_ref(dataset, day) for dataset, day, _ in signed
                                if staged is None or (dataset, day) != (daily, ds)]
        else:
            stored, computed, missing = _classify_days(root, days, recompute=recompute)
            if ds in missing:
                raise MissingInputError(
                    f"features/user_daily and features/pin_daily for ds={ds} are missing and so is raw data to "
                    f"compute them; run `python -m features.build --root {root} --step daily --ds {ds}` once "
                    f"{RAW_EVENTS} and {RAW_PINS} of {ds} have landed"
                )
            validation = check_validated(root, computed, require_validation=require_validation)
            # Read before the aggregates are: a day rebuilt meanwhile then only makes the next day's window full.
            daily_versions = {d: v for d in stored if (v := daily_version(root, d)) is not None}
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
                    f"WHERE {shard_keeps(shard, f'{name}_id')}"
                )
                daily = USER_DAILY if name == "user" else PIN_DAILY
                inputs[name] = [partition_ref(daily, d) for d in stored] + [
                    ref for d in computed for ref in (partition_ref(RAW_EVENTS, d), partition_ref(RAW_PINS, d))
                ]
        if missing:
            log.warning("window of ds=%s: no data for %s (not in the window)", ds, day_spans(missing))
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
        if staged is not None:
            base["staged_day"] = True  # the merge puts the day's published aggregates in inputs and daily_versions
        summary: dict[str, Any] = {
            f"features/{name}_window": {**base, "dataset": f"features/{name}_window", "inputs": inputs[name]}
            for name in ("user", "pin")
        }
        drop_zero = plan is not None
        summary[USER_WINDOW] = write_query(
            con, USER_WINDOW_SQL.replace(DROP_ZERO, USER_WINDOW_DROP_ZERO if drop_zero else ""), None,
            root, USER_WINDOW, ds, USER_WINDOW_SCHEMA, summary[USER_WINDOW], shard=shard,
        )
        con.execute(PIN_SUMS_SQL.replace(DROP_ZERO, PIN_SUMS_DROP_ZERO if drop_zero else ""))
        if recorded_totals is not None:
            totals = recorded_totals
        else:
            totals_row = one_row(con, PIN_TOTALS_SQL.format(source="pin_sums" if shard is None else PIN_TOTALS_OF_ALL_PARTS))
            totals = dict(zip(PIN_TOTAL_COLUMNS, map(int, totals_row), strict=True))
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
        summary[PIN_WINDOW] = write_query(
            con, PIN_WINDOW_SQL, pin_params, root, PIN_WINDOW, ds, PIN_WINDOW_SCHEMA, pin_meta, shard=shard, last_query=True
        )
    return summary
