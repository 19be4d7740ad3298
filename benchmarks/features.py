"""Benchmark of the daily feature build (DuckDB) against pandas and against a full 30-day recompute.

    .venv/bin/python benchmarks/features.py                       # >= 5M events in the day, 30-day history
    .venv/bin/python benchmarks/features.py --events 500000       # a quick run
    .venv/bin/python benchmarks/features.py --events 20800000 --memory-limit 14GB --sharding-only  # shards, 4x day

Setup (not timed): one synthetic day of about ``--events`` events (``features.synthetic``), and a cheap
history of ``--window-days`` days before it (so that the incremental window has a day that leaves): copies of the same day shifted back by whole days (ids
and timestamps), the daily aggregates of those days (the same aggregates, copied), and the window and
sequences of the day before (built once from the raw history).

Measured, each in a fresh subprocess (for its own peak RSS), on the same day:

* ``incremental`` — the daily build as the DAG runs it: aggregates of the day, the window from the daily
  aggregates, the sequences from the previous day's plus the day's events, the examples;
* ``full`` — the same outputs recomputed from the raw events of the whole window (``recompute=True``);
* ``pandas`` — a straightforward pandas (with numpy/pyarrow for I/O and lists) implementation of the
  same four steps with the same inputs, checked against the DuckDB outputs;
* ``sharding`` (benchmark config only) — for each of ``--shards`` (1, 2, 4, 8) shards, the incremental build split
  into that many shards per job (the DAG's two: daily, sequences and examples in one, whose shards build the window
  too when it is incremental, as here; then the window's, which then runs nothing), each shard its own process (as the DAG's array jobs run it; here one after another),
  from the day's events bucketed as validation writes them (``--buckets``, not timed with the build: ``bucketing``)
  and the state a build in as many shards left the day before, each step merged: ``work_vs_unsharded`` is the CPU-
  seconds of the shards and merges over the unsharded build's (the incremental build run just before and after the
  shards, averaged), ``parallel_vs_unsharded`` the time with one machine per shard (each job's slowest shard plus its
  merge) over the unsharded build's, and ``equal`` whether every output holds the unsharded rows.
  ``--sharding-only`` measures only these (for a day too large for the full recompute and pandas).

Two configurations, on the same day: ``default`` (the platform's ``negative_downsample``, 1.0) and ``benchmark``
(``--negative-downsample``, 0.2). ``--repeat N``: N rounds of the three phases per config, each phase's fastest
run counts (and N rounds of each sharded build, ``measure_sharding``). The pandas phase writes the same examples contract (the sequence by reference); untimed, it also
writes the examples with the sequences copied the old way, and ``resolved_sequences_vs_copied`` says whether the
DuckDB examples, resolved as training reads them (``training.data.read_examples``), hold exactly those lists.

Each config prints one JSON line: ``events_per_s`` (events of the day / incremental seconds),
``speedup_vs_pandas``, ``incremental_vs_full`` (incremental seconds / full seconds: the cost ratio),
``peak_rss_mb`` (of the incremental build), ``examples_bytes`` (the day's examples partition on disk), with
the seconds and peaks of every phase. The last line is one JSON object with those five figures of the benchmark
config and, under ``configs``, of both. The synthetic raw data is not validated (``require_validation=False``);
``validation_check_s`` is what checking the day's validation reports would add (fingerprinting its raw events
and pins partitions).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from core import contracts  # noqa: E402
from core.config import FeaturesConfig  # noqa: E402
from core.contracts import (  # noqa: E402
    ACTIONS,
    COUNT_COLUMNS,
    ENGAGEMENTS,
    EXAMPLES_SCHEMA,
    LABELS,
    PIN_DAILY_SCHEMA,
    PIN_WINDOW_SCHEMA,
    RESOLVED_EXAMPLES_SCHEMA,
    USER_DAILY_SCHEMA,
    USER_SEQUENCE_SCHEMA,
    USER_WINDOW_SCHEMA,
)
from core.storage import (  # noqa: E402
    DATA_FILE,
    data_files,
    day_range,
    join,
    partition,
    read_metadata,
    read_table,
    shift_ds,
    write_partition,
    write_table,
)
from features import bucketed_events, build, sharding, spec, step_io  # noqa: E402
from features.steps.daily import build_daily  # noqa: E402
from features.steps.examples import build_examples  # noqa: E402
from features.steps.sequences import build_sequences  # noqa: E402
from features.steps.window import build_window  # noqa: E402

DAY = "2026-06-30"
DAY_US = 86_400 * 1_000_000
EVENT_ID_DAY_STRIDE = 10**9
# Events per user and day in the synthetic world (about 20 impressions and their engagements, 90% active).
EVENTS_PER_USER = 21.5
OUTPUTS = contracts.FEATURE_OUTPUTS


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    """This process's peak RSS. ``VmHWM`` starts afresh at exec; ``ru_maxrss`` would carry the driver's peak into
    every phase's subprocess."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --- setup ----------------------------------------------------------------------------------------------


def setup(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from features.synthetic import WorldConfig, generate_world

    users = math.ceil(args.events / EVENTS_PER_USER)
    # The generator simulates burn-in days too: generate a quarter of the users and tile them 4 times
    # (user and event ids offset), which gives the same volume and per-user shape in a quarter of the time.
    tiles = 4
    base_users = math.ceil(users / tiles)
    say(f"generating one day of ~{args.events} events ({base_users} users x {tiles} tiles)")
    generated = root / "generated"
    generate_world(
        generated, WorldConfig(start=DAY, days=1, users=base_users, pins=max(1000, users // 2), seed=1, active_rate=0.9)
    )
    shutil.copytree(partition(generated, contracts.RAW_PINS, DAY), partition(root, contracts.RAW_PINS, DAY))
    engine = step_io.DuckDBSettings(threads=args.threads, memory_limit=args.memory_limit)
    base_file = data_files(generated, contracts.RAW_EVENTS, DAY)[0]
    with step_io.connect(engine) as con, write_partition(root, contracts.RAW_EVENTS, DAY) as tmp:
        con.execute(
            f"""COPY (SELECT event_id + k * 200000000 AS event_id, impression_id + k * 200000000 AS impression_id,
                             user_id + k * {base_users} AS user_id, pin_id, action, surface, ts
                      FROM read_parquet('{base_file}'), range({tiles}) AS r(k)
                      ORDER BY event_id)
                TO '{join(tmp, DATA_FILE)}' (FORMAT parquet)"""
        )
    shutil.rmtree(generated)

    history = day_range(shift_ds(DAY, -args.window_days), shift_ds(DAY, -1))
    say(f"writing {len(history)} history days (the day shifted back)")
    source = data_files(root, contracts.RAW_EVENTS, DAY)[0]
    with step_io.connect(engine) as con:
        for day in history:
            back = (np.datetime64(DAY) - np.datetime64(day)).astype(int)
            with write_partition(root, contracts.RAW_EVENTS, day) as tmp:
                con.execute(
                    f"""COPY (SELECT event_id - {back * EVENT_ID_DAY_STRIDE} AS event_id,
                                     impression_id - {back * EVENT_ID_DAY_STRIDE} AS impression_id,
                                     user_id, pin_id, action, surface, ts - INTERVAL {back} DAY AS ts
                              FROM read_parquet('{source}'))
                        TO '{join(tmp, DATA_FILE)}' (FORMAT parquet)"""
                )
            shutil.copytree(partition(root, contracts.RAW_PINS, DAY), partition(root, contracts.RAW_PINS, day))
    # The history's daily aggregates: those of one history day, copied to the others (same events, shifted).
    say("building the history's daily aggregates, window and sequences of the day before")
    build_daily(root, history[-1], require_validation=False, engine=engine)
    for day in history[:-1]:
        for dataset in (contracts.USER_DAILY, contracts.PIN_DAILY):
            shutil.copytree(partition(root, dataset, history[-1]), partition(root, dataset, day))
    build_window(root, history[-1], args.window_days, require_validation=False, engine=engine)
    build_sequences(
        root, history[-1], args.sequence_length, args.window_days, recompute=True, require_validation=False,
        engine=engine,
    )
    events = pq.read_metadata(data_files(root, contracts.RAW_EVENTS, DAY)[0]).num_rows
    return {"events": int(events), "history_days": len(history), "users": users}


# --- measured phases (each in its own process) ----------------------------------------------------------


def cpu_s() -> float:
    """CPU-seconds of this process so far, every thread's (DuckDB's and the Parquet writers')."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_features(args: argparse.Namespace) -> FeaturesConfig:
    """The ``features:`` settings of the benchmark's builds."""
    return step_io.DEFAULTS.model_copy(update={
        "window_days": args.window_days, "sequence_length": args.sequence_length,
        "negative_downsample": args.negative_downsample, "negative_downsample_seed": args.seed,
    })


def phase_shard(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One shard of one step of DAY (``--step``, ``--shard`` of ``--shards``), as one job of the array runs it."""
    features = bench_features(args)
    engine = step_io.DuckDBSettings(threads=args.threads, memory_limit=args.memory_limit)
    cpu, started = cpu_s(), time.perf_counter()
    build.build_step(root, DAY, args.step, features, require_validation=False, engine=engine,
                     shard=sharding.Shard(args.shard, args.shards, str(root / "_staging" / args.step)))
    return {"seconds": time.perf_counter() - started, "cpu_s": cpu_s() - cpu, "peak_rss_mb": peak_rss_mb()}


def phase_buckets(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The day's events bucketed by user and by pin (what validation adds when the build is sharded)."""
    engine = step_io.DuckDBSettings(threads=args.threads, memory_limit=args.memory_limit)
    cpu, started = cpu_s(), time.perf_counter()
    bucketed_events.write_event_buckets(root, DAY, args.buckets, engine=engine)
    return {"seconds": time.perf_counter() - started, "cpu_s": cpu_s() - cpu, "peak_rss_mb": peak_rss_mb()}


def relay_state(source: Path, target: Path, shards: int, window_days: int) -> None:
    """The state a day built in ``shards`` shards left (not timed): the day before's window and sequences and the
    leaving day's daily aggregates as a merge writes them (part-i: the rows of shard i, ``hash_buckets``), with the
    same publish stamps (so the incremental paths are taken), from the unsharded ones of ``source``."""
    prev, leaving = shift_ds(DAY, -1), shift_ds(DAY, -window_days)
    relaid = [(d, prev) for d in (contracts.USER_WINDOW, contracts.PIN_WINDOW, contracts.USER_SEQUENCE)]
    relaid += [(d, leaving) for d in (contracts.USER_DAILY, contracts.PIN_DAILY)]
    with step_io.connect(step_io.DuckDBSettings(threads=2)) as con:
        for dataset, day in relaid:
            src, dst = Path(partition(source, dataset, day)), Path(partition(target, dataset, day))
            if dst.is_symlink():
                dst.unlink()
            dst.mkdir(parents=True)
            key = sharding.DATASET_KEYS[dataset]
            files = ", ".join(f"'{f}'" for f in data_files(source, dataset, day))
            schema = contracts.FEATURE_SCHEMAS[dataset]
            for i in range(shards):
                # Written as a shard writes its file (the same writer and row groups), not as DuckDB's COPY would.
                rows = con.sql(f"SELECT * FROM read_parquet([{files}]) WHERE hash({key}) % {shards} = {i} ORDER BY {key}")
                with step_io.ShardFile(str(dst / sharding.shard_file(i)), schema, step_io.shard_row_groups(dataset)) as out:
                    out.write(step_io.conform(rows.to_arrow_table(), schema))
            meta = read_metadata(source, dataset, day) | {"shards": shards,
                                                          "hash_buckets": sharding.hash_layout(key, shards)}
            if "content_digest" in meta:  # as the merge records it: of the shards' digests
                tables = [pq.read_table(dst / sharding.shard_file(i)) for i in range(shards)]
                meta["content_digest"] = contracts.combined_digest([
                    contracts.sequence_digest(t.select(USER_SEQUENCE_SCHEMA.names).cast(USER_SEQUENCE_SCHEMA)) for t in tables
                ])
            (dst / "_metadata.json").write_text(json.dumps(meta))
            shutil.copy(src / "_SUCCESS", dst / "_SUCCESS")


def phase_duckdb(root: Path, args: argparse.Namespace, *, recompute: bool) -> dict[str, Any]:
    from features.validation.report import content_fingerprint

    engine = step_io.DuckDBSettings(threads=args.threads, memory_limit=args.memory_limit)
    steps = {
        "daily": lambda: build_daily(root, DAY, require_validation=False, engine=engine),
        "window": lambda: build_window(root, DAY, args.window_days, recompute=recompute, require_validation=False, engine=engine),
        "sequences": lambda: build_sequences(
            root, DAY, args.sequence_length, args.window_days, recompute=recompute, require_validation=False, engine=engine
        ),
        "examples": lambda: build_examples(
            root, DAY, negative_downsample=args.negative_downsample, seed=args.seed, require_validation=False, engine=engine
        ),
    }
    summary: dict[str, Any] = {}
    step_seconds = {}
    cpu = cpu_s()
    # As ``build.build_day`` runs them: a step's last files encode while the next one's query runs, except that the
    # window starts once the day's aggregates are published. A step's seconds end where the next one starts (the last
    # of a block's where every output of the block is published).
    for block in (["daily"], ["window", "sequences", "examples"]):
        with step_io.overlapped_outputs():
            for step in block:
                started = time.perf_counter()
                summary |= steps[step]()
                step_seconds[step] = time.perf_counter() - started
        step_seconds[block[-1]] = time.perf_counter() - started
    step_seconds = {step: round(seconds, 3) for step, seconds in step_seconds.items()}
    cpu = cpu_s() - cpu
    started = time.perf_counter()
    for dataset in (contracts.RAW_EVENTS, contracts.RAW_PINS):
        content_fingerprint(partition(root, dataset, DAY))
    check_s = time.perf_counter() - started
    return {
        "seconds": sum(step_seconds.values()),
        "cpu_s": round(cpu, 3),
        "step_seconds": step_seconds,
        "peak_rss_mb": peak_rss_mb(),
        "validation_check_s": round(check_s, 4),
        "window_mode": summary[contracts.USER_WINDOW]["mode"],
        "sequences_mode": summary[contracts.USER_SEQUENCE]["mode"],
        "rows": {dataset: summary[dataset]["rows"] for dataset in OUTPUTS},
    }


def _nest(keys: np.ndarray, fields: dict[str, pa.Array], sort_keys: np.ndarray | None = None) -> tuple[np.ndarray, pa.Array]:
    """Group rows sorted by ``keys`` into one list per key: (unique keys, list<struct> or list array)."""
    unique, starts = np.unique(keys, return_index=True)
    offsets = pa.array(np.append(starts, len(keys)).astype(np.int32))
    values = fields[next(iter(fields))] if len(fields) == 1 else pa.StructArray.from_arrays(list(fields.values()), list(fields))
    return unique, pa.ListArray.from_arrays(offsets, values)


def _hash_keep(impression_ids: np.ndarray, seed: int) -> np.ndarray:
    return np.array(
        [int(hashlib.md5(f"{seed}:{i}".encode()).hexdigest()[:13], 16) / 2**52 for i in impression_ids.tolist()]
    )


def phase_pandas(root: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same four outputs of DAY with pandas (reads the same inputs, writes under ``out``)."""
    import pandas as pd

    started = time.perf_counter()
    prev = shift_ds(DAY, -1)
    events = read_table(root, contracts.RAW_EVENTS, DAY).to_pandas()
    events["ts"] = events["ts"].dt.tz_convert(None)  # naive UTC: numpy datetime64 columns, not objects
    pins = read_table(root, contracts.RAW_PINS, DAY, columns=["pin_id", "category", "creator_id"]).to_pandas()
    action_names = dict(zip(ACTIONS, COUNT_COLUMNS, strict=True))

    # Daily aggregates.
    counts = {}
    for key, other, distinct in (("user_id", "pin_id", "distinct_pins"), ("pin_id", "user_id", "distinct_users")):
        table = (
            events.groupby([key, "action"]).size().unstack(fill_value=0).reindex(columns=list(ACTIONS), fill_value=0)
        )
        table.columns = [action_names[a] for a in table.columns]
        table[distinct] = events.groupby(key)[other].nunique()
        counts[key] = table.reset_index().sort_values(key)
    ev = events.merge(pins[["pin_id", "category"]], on="pin_id", how="left")
    ev["category"] = ev["category"].fillna(step_io.UNKNOWN_ID).astype(np.int32)
    ev["is_impression"] = ev["action"] == "impression"
    ev["is_engagement"] = ~ev["is_impression"]
    per_cat = (
        ev.groupby(["user_id", "category"])
        .agg(impressions=("is_impression", "sum"), engagements=("is_engagement", "sum"))
        .reset_index()
    )

    def categories_column(long: pd.DataFrame) -> pa.Array:
        _, lists = _nest(
            long["user_id"].to_numpy(),
            {
                "category": pa.array(long["category"].to_numpy(np.int32)),
                "impressions": pa.array(long["impressions"].to_numpy(np.int64)),
                "engagements": pa.array(long["engagements"].to_numpy(np.int64)),
            },
        )
        return lists

    user_daily = pa.Table.from_pandas(counts["user_id"], preserve_index=False).append_column(
        "categories", categories_column(per_cat)
    )
    write_table(out, contracts.USER_DAILY, DAY, user_daily.select(USER_DAILY_SCHEMA.names).cast(USER_DAILY_SCHEMA))
    pin_daily = pa.Table.from_pandas(counts["pin_id"], preserve_index=False)
    write_table(out, contracts.PIN_DAILY, DAY, pin_daily.select(PIN_DAILY_SCHEMA.names).cast(PIN_DAILY_SCHEMA))

    # Window: the daily aggregates of the window's days (this day from above, the others from storage).
    days = day_range(shift_ds(DAY, -(args.window_days - 1)), DAY)
    daily_tables = [read_table(out if d == DAY else root, contracts.USER_DAILY, d) for d in days]
    flat = []
    for t in daily_tables:
        lengths = pc.list_value_length(t["categories"]).to_numpy()
        cats = pc.list_flatten(t["categories"])
        flat.append(
            pd.DataFrame(
                {
                    "user_id": np.repeat(t["user_id"].to_numpy(), lengths),
                    "category": pc.struct_field(cats, "category").to_numpy(),
                    "impressions": pc.struct_field(cats, "impressions").to_numpy(),
                    "engagements": pc.struct_field(cats, "engagements").to_numpy(),
                }
            )
        )
    user_sums = (
        pd.concat([t.drop_columns(["categories"]).to_pandas() for t in daily_tables])
        .groupby("user_id")[list(COUNT_COLUMNS)]
        .sum()
        .reset_index()
        .sort_values("user_id")
    )
    user_sums["ctr"] = np.where(user_sums["impressions"] > 0, user_sums["clicks"] / user_sums["impressions"].clip(lower=1), 0.0)
    cat_sums = pd.concat(flat).groupby(["user_id", "category"])[["impressions", "engagements"]].sum().reset_index()
    user_window = pa.Table.from_pandas(user_sums, preserve_index=False).append_column(
        "categories", categories_column(cat_sums)
    )
    write_table(out, contracts.USER_WINDOW, DAY, user_window.select(USER_WINDOW_SCHEMA.names).cast(USER_WINDOW_SCHEMA))
    pin_sums = (
        pd.concat([read_table(out if d == DAY else root, contracts.PIN_DAILY, d).to_pandas() for d in days])
        .groupby("pin_id")[list(COUNT_COLUMNS)]
        .sum()
        .reset_index()
        .sort_values("pin_id")
    )
    prior = 20.0
    for count, rate in (("clicks", "ctr"), ("repins", "repin_rate"), ("hides", "hide_rate")):
        global_rate = pin_sums[count].sum() / pin_sums["impressions"].sum()
        pin_sums[rate] = (pin_sums[count] + prior * global_rate) / (pin_sums["impressions"] + prior)
    write_table(out, contracts.PIN_WINDOW, DAY, pa.Table.from_pandas(pin_sums, preserve_index=False).cast(PIN_WINDOW_SCHEMA))

    # Sequences: the previous day's state plus the day's engagements, last N per user within the window.
    state = read_table(root, contracts.USER_SEQUENCE, prev)
    lengths = pc.list_value_length(state["seq_pin_ids"]).to_numpy()
    previous = pd.DataFrame(
        {
            "user_id": np.repeat(state["user_id"].to_numpy(), lengths),
            "pin_id": pc.list_flatten(state["seq_pin_ids"]).to_numpy(),
            "action_idx": pc.list_flatten(state["seq_actions"]).to_numpy(),
            "ts": pc.list_flatten(state["seq_ts"]).to_numpy(),
        }
    )
    new = events[events["action"].isin(ENGAGEMENTS)]
    new = pd.DataFrame(
        {
            "user_id": new["user_id"].to_numpy(),
            "pin_id": new["pin_id"].to_numpy(),
            "action_idx": new["action"].map({a: i for i, a in enumerate(ACTIONS)}).to_numpy(np.int32),
            "ts": new["ts"].to_numpy(),
        }
    )
    items = pd.concat([previous, new], ignore_index=True)
    window_start = np.datetime64(days[0])
    items = items[items["ts"].to_numpy().astype("datetime64[us]") >= window_start]
    items = items.sort_values(["user_id", "ts", "pin_id", "action_idx"], ascending=[True, False, False, False])
    items = items[items.groupby("user_id").cumcount() < args.sequence_length]
    items = items.merge(pins[["pin_id", "category"]], on="pin_id", how="left", sort=False)
    items["category"] = items["category"].fillna(step_io.UNKNOWN_ID).astype(np.int32)
    seq_users, seq_pins = _nest(items["user_id"].to_numpy(), {"p": pa.array(items["pin_id"].to_numpy())})
    sequences = pa.table(
        {
            "user_id": seq_users,
            "seq_pin_ids": seq_pins,
            "seq_actions": _nest(items["user_id"].to_numpy(), {"a": pa.array(items["action_idx"].to_numpy(np.int32))})[1],
            "seq_categories": _nest(items["user_id"].to_numpy(), {"c": pa.array(items["category"].to_numpy())})[1],
            "seq_ts": _nest(items["user_id"].to_numpy(), {"t": pa.array(items["ts"].to_numpy(), pa.timestamp("us", tz="UTC"))})[1],
        }
    )
    write_table(out, contracts.USER_SEQUENCE, DAY, sequences.cast(USER_SEQUENCE_SCHEMA))

    # Examples: the day's impressions with labels, features of the day before.
    imps = events[events["action"] == "impression"][["impression_id", "ts", "user_id", "pin_id", "surface"]]
    eng = events[events["action"] != "impression"]
    for label in LABELS:
        positive = eng.loc[eng["action"] == label, "impression_id"].unique()
        imps[label] = imps["impression_id"].isin(positive).astype(np.int8)
    imps = imps.merge(pins, on="pin_id", how="left")
    imps[["category", "creator_id"]] = imps[["category", "creator_id"]].fillna(step_io.UNKNOWN_ID)
    uw = read_table(root, contracts.USER_WINDOW, prev).drop_columns(["categories"]).to_pandas()
    pw = read_table(root, contracts.PIN_WINDOW, prev).to_pandas()
    uw.columns = ["user_id", *[f"u_{c}" for c in uw.columns[1:]]]
    pw.columns = ["pin_id", *[f"p_{c}" for c in pw.columns[1:]]]
    imps = imps.merge(uw, on="user_id", how="left").merge(pw, on="pin_id", how="left")
    rates = read_metadata(root, contracts.PIN_WINDOW, prev)["global_rates"]
    for column in imps.columns:
        if column.startswith("u_") or (column.startswith("p_") and column[2:] in COUNT_COLUMNS):
            imps[column] = imps[column].fillna(0.0)
    for rate in ("ctr", "repin_rate", "hide_rate"):
        imps[f"p_{rate}"] = imps[f"p_{rate}"].fillna(rates[rate])  # smoothed(0, 0) = the global rate
    positive = imps[list(LABELS)].max(axis=1) == 1
    keep = positive.to_numpy() | (_hash_keep(imps["impression_id"].to_numpy(), args.seed) < args.negative_downsample)
    imps = imps[keep].sort_values("impression_id").reset_index(drop=True)
    # The sequence by reference: the user's row of the day before's sequences, all its actions (seq_len).
    seq_state = read_table(root, contracts.USER_SEQUENCE, prev, columns=["user_id", "seq_ts"])
    seq_lengths = pd.Series(pc.list_value_length(seq_state["seq_ts"]).to_numpy(), index=seq_state["user_id"].to_numpy())
    imps["seq_ds"] = dt.date.fromisoformat(prev)
    imps["seq_len"] = imps["user_id"].map(seq_lengths).fillna(0).astype(np.int32)
    imps["ts"] = imps["ts"].dt.tz_localize("UTC")
    table = pa.Table.from_pandas(imps, preserve_index=False)
    meta = {"sequence_digest": read_metadata(root, contracts.USER_SEQUENCE, prev)["content_digest"]}
    write_table(out, contracts.EXAMPLES, DAY, table.select(EXAMPLES_SCHEMA.names).cast(EXAMPLES_SCHEMA), meta)
    seconds = time.perf_counter() - started
    peak = peak_rss_mb()
    # Not timed: the examples with the sequence copied into every row (what the build wrote before it stored
    # references), to check that resolving the references gives exactly these lists.
    write_table(out / "copied", contracts.EXAMPLES, DAY, copied_sequences(root, prev, table))
    return {"seconds": seconds, "peak_rss_mb": peak}


def copied_sequences(root: Path, prev: str, examples: pa.Table) -> pa.Table:
    """impression_id and the four sequence lists of ``examples``, copied from the sequences of ``prev`` (pandas)."""
    import pandas as pd

    seq_state = read_table(root, contracts.USER_SEQUENCE, prev)
    position = pd.Series(np.arange(seq_state.num_rows), index=seq_state["user_id"].to_numpy())
    rows = pa.array(examples["user_id"].to_pandas().map(position), from_pandas=True)  # NaN (no sequence) -> null
    taken = seq_state.take(pc.cast(rows, pa.int64()))
    empty = {"seq_pin_ids": pa.int64(), "seq_actions": pa.int32(), "seq_categories": pa.int32(), "seq_ts": pa.timestamp("us", tz="UTC")}
    lists = {name: pc.if_else(pc.is_null(taken[name]), pa.scalar([], pa.list_(t)), taken[name]) for name, t in empty.items()}
    seq_lengths = pc.list_value_length(lists["seq_ts"]).to_numpy()
    seq_ts = pc.list_flatten(lists["seq_ts"]).to_numpy().astype("datetime64[us]").astype(np.int64)
    imp_ts = np.repeat(pc.cast(examples["ts"], pa.int64()).to_numpy(), seq_lengths)
    ages = pa.array(((imp_ts - seq_ts) / 3600e6).astype(np.float32))
    offsets = pa.array(np.concatenate([[0], np.cumsum(seq_lengths)]).astype(np.int32))
    columns = {"impression_id": examples["impression_id"]}
    columns |= {name: lists[name] for name in ("seq_pin_ids", "seq_actions", "seq_categories")}
    columns["seq_age_hours"] = pa.ListArray.from_arrays(offsets, ages)
    return pa.table(columns).cast(pa.schema([RESOLVED_EXAMPLES_SCHEMA.field(name) for name in columns]))


def resolved_equals_copied(root: Path, copied_root: Path) -> str:
    """'equal' when the examples of DAY under ``root``, their references resolved as training reads them, hold
    exactly the sequence lists of ``copied_root`` (the pandas copy); else what differs."""
    from training.data import read_examples

    copied = read_table(copied_root, contracts.EXAMPLES, DAY)
    resolved = read_examples(root, DAY, copied.column_names)
    if resolved.equals(copied):
        return "equal"
    return f"differ in {[n for n in copied.column_names if not resolved[n].equals(copied[n])]}"


SORT_KEYS = {
    contracts.USER_DAILY: "user_id", contracts.PIN_DAILY: "pin_id", contracts.USER_WINDOW: "user_id",
    contracts.PIN_WINDOW: "pin_id", contracts.USER_SEQUENCE: "user_id", contracts.EXAMPLES: "impression_id",
}


def compare_rows(a: Path, b: Path) -> dict[str, str]:
    """Per output of DAY: 'equal' if both hold the same rows (in any order: a sharded build has a file per shard)."""
    return {
        dataset: "equal" if read_table(a, dataset, DAY).sort_by(key).equals(read_table(b, dataset, DAY).sort_by(key))
        else "rows differ"
        for dataset, key in SORT_KEYS.items()
    }


def compare(a: Path, b: Path, *, strict: bool) -> dict[str, str]:
    """Per output of DAY: 'equal', 'equal within 1e-6' (floats, unless ``strict``), or what differs."""
    result = {}
    for dataset in OUTPUTS:
        left, right = read_table(a, dataset, DAY), read_table(b, dataset, DAY)
        if left.equals(right):
            result[dataset] = "equal"
        elif left.num_rows != right.num_rows:
            result[dataset] = f"rows differ: {left.num_rows} != {right.num_rows}"
        else:
            differ = [
                name
                for name in left.column_names
                if not left[name].equals(right[name])
                and (
                    strict
                    or not pa.types.is_floating(left[name].type)
                    or not np.allclose(left[name].to_numpy(), right[name].to_numpy(), rtol=1e-6, atol=1e-9)
                )
            ]
            result[dataset] = f"columns differ: {differ}" if differ else "equal within 1e-6"
    return result


# --- driver ---------------------------------------------------------------------------------------------


def run_phase(name: str, args: argparse.Namespace, root: Path, extra: list[str] | None = None) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--phase", name, "--root", str(root),
        "--window-days", str(args.window_days), "--sequence-length", str(args.sequence_length),
        "--negative-downsample", str(args.negative_downsample), "--seed", str(args.seed),
        "--threads", str(args.threads), "--memory-limit", args.memory_limit, *(extra or []),
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def link_inputs(source: Path, target: Path, window_days: int) -> None:
    """A root that sees the raw data and the day before's features of ``source`` but none of DAY's outputs."""
    (target / "raw").symlink_to(source / "raw")
    if (source / "buckets").exists():
        (target / "buckets").symlink_to(source / "buckets")
    prev = shift_ds(DAY, -1)
    for dataset in (contracts.USER_WINDOW, contracts.PIN_WINDOW, contracts.USER_SEQUENCE):
        link = Path(partition(target, dataset, prev))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(partition(source, dataset, prev))
    for day in day_range(shift_ds(DAY, -(window_days - 1)), prev):
        for dataset in (contracts.USER_DAILY, contracts.PIN_DAILY):
            link = Path(partition(target, dataset, day))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(partition(source, dataset, day))


# The figures of each shard count in the last line (the rest in the config's own line).
SHARDING_HEADLINE = ("work_vs_unsharded", "parallel_vs_unsharded", "equal", "mean_shard_parallel_vs_unsharded")


def measure_sharding(args: argparse.Namespace, root: Path, sharded_root: Path, count: int) -> dict[str, Any]:
    """The incremental build of DAY in ``count`` shards per job of the DAG (``spec.DAY_JOBS``), each shard a process
    as the array job runs it (one after another here), from the state a ``count``-shard build of the day before left;
    each job merged.

    ``work_vs_unsharded``: the shards' and merges' CPU-seconds (every thread) over the unsharded build's (the same
    measure, interpreter start excluded on both sides; ``process_work_vs_unsharded`` includes each shard process's
    start and imports). ``parallel_vs_unsharded``: each job's slowest shard plus its merge, in seconds, over the
    unsharded build's seconds (a machine per shard); ``mean_shard_parallel_vs_unsharded`` the same with each job's
    mean shard instead of its slowest: the shards hold the same rows within about 1%, so here, run one after another
    on one machine, the gap between the two is the machine's noise more than the shards'. The unsharded build is the
    incremental phase run just before and just after the shards, averaged (``unsharded``): this machine's speed
    drifts by a third over minutes (its page cache, its neighbours), which a baseline from the start of the run
    would put into the ratios. ``--repeat N`` (N > 1): N rounds of the shards, the unsharded build after each, and
    each shard, merge and the unsharded build count with their fastest run (as the phases of ``measure``).
    ``equal``: every output holds the unsharded build's rows (in every round).
    """
    say(f"sharding: {count} shard(s) per job")
    rounds = max(1, args.repeat)
    baseline = [run_phase("incremental", args, root)]
    settings = build.recorded_settings(bench_features(args), skip_validation=True)
    # By job: each shard's (seconds, CPU-s, process CPU-s) of every round, and the merge's (seconds, CPU-s).
    shard_runs: dict[str, list[list[tuple[float, float, float]]]] = {}
    merge_runs: dict[str, list[tuple[float, float]]] = {}
    steps: dict[str, Any] = {}
    equal: dict[str, str] = {}
    for round_ in range(1, rounds + 1):
        if rounds > 1:
            say(f"  round {round_}/{rounds}")
        shutil.rmtree(sharded_root, ignore_errors=True)
        sharded_root.mkdir()
        link_inputs(root, sharded_root, args.window_days)
        relay_state(root, sharded_root, count, args.window_days)
        for step in spec.DAY_JOBS:  # the DAG's build jobs: daily, sequences and examples in one, then the window
            if step == "window" and build.window_built_by_group(sharded_root, DAY, settings):
                steps[step] = {"built_by": spec.DAY_JOBS[0]}  # as the DAG's window task: no job (spec.STAGED_STEPS)
                continue
            runs = shard_runs.setdefault(step, [[] for _ in range(count)])
            for index in range(count):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                result = run_phase("shard", args, sharded_root, ["--step", step, "--shard", str(index), "--shards", str(count)])
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                process = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                runs[index].append((result["seconds"], result["cpu_s"], process))
            merge_cpu, started = cpu_s(), time.perf_counter()
            build.merge_shards(sharded_root, DAY, step, str(sharded_root / "_staging" / step), count)
            merge_runs.setdefault(step, []).append((time.perf_counter() - started, cpu_s() - merge_cpu))
        for dataset, verdict in compare_rows(root, sharded_root).items():
            if equal.get(dataset, "equal") == "equal":  # a round that differed stays said
                equal[dataset] = verdict
        baseline.append(run_phase("incremental", args, root))
    cpu = process_cpu = parallel = parallel_mean = 0.0
    for step, runs in shard_runs.items():
        # Each shard's and each merge's fastest round (one round: its only run).
        seconds = [round(min(r[0] for r in shard), 3) for shard in runs]
        cpus = [round(min(r[1] for r in shard), 3) for shard in runs]
        merge_s, merge_cpu = (min(m[i] for m in merge_runs[step]) for i in (0, 1))
        cpu += sum(cpus) + merge_cpu
        process_cpu += sum(min(r[2] for r in shard) for shard in runs) + merge_cpu
        parallel += max(seconds) + merge_s
        parallel_mean += sum(seconds) / len(seconds) + merge_s
        steps[step] = {"shard_seconds": seconds, "shard_cpu_s": cpus, "merge_s": round(merge_s, 3)}
    steps = {step: steps[step] for step in spec.DAY_JOBS if step in steps}
    # One round: the unsharded build run just before and after the shards, averaged; more: its fastest run, as the
    # shards' (the fastest of each side: a shared machine's noise only ever adds time).
    pick = (lambda values: sum(values) / len(values)) if rounds == 1 else min
    unsharded = {key: pick([b[key] for b in baseline]) for key in ("cpu_s", "seconds")}
    result = {
        "work_vs_unsharded": round(cpu / unsharded["cpu_s"], 3),
        "parallel_vs_unsharded": round(parallel / unsharded["seconds"], 3),
        "equal": all(v == "equal" for v in equal.values()),
        "mean_shard_parallel_vs_unsharded": round(parallel_mean / unsharded["seconds"], 3),
        "process_work_vs_unsharded": round(process_cpu / unsharded["cpu_s"], 3),
        "cpu_s": round(cpu, 3),
        "parallel_s": round(parallel, 3),
        "unsharded": {key: [round(b[key], 3) for b in baseline] for key in ("cpu_s", "seconds")},
        "steps": steps,
        "rounds": rounds,
        **({} if all(v == "equal" for v in equal.values()) else {"differ": equal}),
    }
    say(f"  {result['work_vs_unsharded']}x the work, {result['parallel_vs_unsharded']}x the time "
        f"({result['mean_shard_parallel_vs_unsharded']}x with the mean shard), equal {result['equal']}")
    return result


def measure(args: argparse.Namespace, world: dict[str, Any], root: Path, full_root: Path, pandas_root: Path,
            sharded_root: Path) -> dict[str, Any]:
    """The three phases of one configuration on the same day, and how their outputs compare.

    ``args.repeat`` rounds, each phase once per round in turn; each phase's fastest run counts (a shared machine's
    noise only ever adds time).
    """
    best: dict[str, dict[str, Any]] = {}
    for round_ in range(1, args.repeat + 1):
        for phase, phase_root, extra in (
            ("incremental", root, None),
            ("full", full_root, None),
            ("pandas", root, ["--out", str(pandas_root)]),
        ):
            say(f"round {round_}/{args.repeat}: {phase}")
            if phase == "pandas":
                shutil.rmtree(pandas_root, ignore_errors=True)
            result = run_phase(phase, args, phase_root, extra)
            say(f"  {result['seconds']:.1f}s, peak RSS {result['peak_rss_mb']:.0f} MB")
            if phase not in best or result["seconds"] < best[phase]["seconds"]:
                best[phase] = result
    incremental, full, pandas = best["incremental"], best["full"], best["pandas"]
    sharding = {str(count): measure_sharding(args, root, sharded_root, count) for count in args.shard_counts}

    events = world["events"]
    return {
        "events": events,
        "history_days": world["history_days"],
        "threads": args.threads,
        "memory_limit": args.memory_limit,
        "negative_downsample": args.negative_downsample,
        "sequence_length": args.sequence_length,
        "repeat": args.repeat,
        "seconds": {"incremental": incremental["seconds"], "full": full["seconds"], "pandas": pandas["seconds"]},
        "step_seconds": {"incremental": incremental["step_seconds"], "full": full["step_seconds"]},
        "peak_rss_mb_by_phase": {
            "incremental": incremental["peak_rss_mb"],
            "full": full["peak_rss_mb"],
            "pandas": pandas["peak_rss_mb"],
        },
        "rows": incremental["rows"],
        "incremental_equals_full": compare(root, full_root, strict=True),
        "duckdb_vs_pandas": compare(root, pandas_root, strict=False),
        "resolved_sequences_vs_copied": resolved_equals_copied(root, pandas_root / "copied"),
        "events_per_s": round(events / incremental["seconds"]),
        "speedup_vs_pandas": round(pandas["seconds"] / incremental["seconds"], 2),
        "incremental_vs_full": round(incremental["seconds"] / full["seconds"], 3),
        "peak_rss_mb": round(incremental["peak_rss_mb"]),
        "examples_bytes": sum(
            f.stat().st_size for f in Path(partition(root, contracts.EXAMPLES, DAY)).iterdir() if f.is_file()
        ),
        "modes": {
            phase: {"window": result["window_mode"], "sequences": result["sequences_mode"]}
            for phase, result in (("incremental", incremental), ("full", full))
        },
        "validation_check_s": incremental["validation_check_s"],
        "cpu_s": {"incremental": incremental["cpu_s"], "full": full["cpu_s"]},
        **({"sharding": sharding} if sharding else {}),
    }


def measure_sharding_only(args: argparse.Namespace, world: dict[str, Any], root: Path, sharded_root: Path) -> dict[str, Any]:
    """``--sharding-only``: the sharded builds of the benchmark config (each with its unsharded baseline), without the
    full recompute and pandas (which need about 4x and 8x the memory of the build): the curve at day sizes that one
    machine cannot compare against pandas."""
    sharding = {str(count): measure_sharding(args, root, sharded_root, count) for count in args.shard_counts}
    return {
        "events": world["events"], "negative_downsample": args.negative_downsample,
        "sharding": {count: {k: r[k] for k in SHARDING_HEADLINE}
                     for count, r in sharding.items()},
        "sharding_details": sharding,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5_200_000, help="events in the measured day (default: 5.2M)")
    parser.add_argument("--window-days", type=int, default=30)
    parser.add_argument("--sequence-length", type=int, default=50)
    parser.add_argument("--negative-downsample", type=float, default=0.2,
                        help="the benchmark config's rate (default: 0.2); the default config uses the platform's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="DuckDB threads (default: 2)")
    parser.add_argument("--memory-limit", default="4GB", help="DuckDB memory limit (default: 4GB)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of the three phases per config; each phase's fastest counts (default: 1)")
    parser.add_argument("--shards", default="1,2,4,8",
                        help="shard counts of the sharded builds (benchmark config only; empty: skip; default: 1,2,4,8)")
    parser.add_argument("--buckets", type=int, default=step_io.DEFAULTS.event_buckets,
                        help="buckets of the day's events that the shards read (default: %(default)s)")
    parser.add_argument("--sharding-only", action="store_true",
                        help="measure only the unsharded incremental build and the sharded builds (benchmark config): "
                        "for days too large for the full recompute and pandas on this machine")
    parser.add_argument("--workdir", default=None, help="where to build (default: a temporary folder, removed)")
    parser.add_argument("--phase", choices=("incremental", "full", "pandas", "shard", "buckets"), help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shard_counts = [int(n) for n in str(args.shards).split(",") if n.strip()]

    if args.phase:
        root = Path(args.root)
        if args.phase == "pandas":
            result = phase_pandas(root, Path(args.out), args)
        elif args.phase == "shard":
            args.shards = args.shard_counts[0]
            result = phase_shard(root, args)
        elif args.phase == "buckets":
            result = phase_buckets(root, args)
        else:
            result = phase_duckdb(root, args, recompute=args.phase == "full")
        print(json.dumps(result))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="pinflow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        root, full_root, pandas_root = work / "root", work / "full", work / "pandas"
        sharded_root = work / "sharded"
        for path in (root, full_root, pandas_root):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
        started = time.perf_counter()
        world = setup(root, args)
        setup_s = time.perf_counter() - started
        say(f"setup done in {setup_s:.0f}s: {world['events']} events in {DAY}, {world['history_days']} history days")
        bucketing = None
        if args.shard_counts:
            bucketing = run_phase("buckets", args, root, ["--buckets", str(args.buckets)])
            say(f"events bucketed in {bucketing['seconds']:.1f}s ({bucketing['cpu_s']:.1f} CPU-s)")
        if args.sharding_only:
            print(json.dumps(measure_sharding_only(args, world, root, sharded_root)), flush=True)
            return 0
        link_inputs(root, full_root, args.window_days)

        configs = {"default": step_io.DEFAULTS.negative_downsample, "benchmark": args.negative_downsample}
        results = {}
        for name, rate in configs.items():
            say(f"config {name}: negative_downsample {rate}")
            counts = args.shard_counts if name == "benchmark" else []
            results[name] = measure(
                argparse.Namespace(**{**vars(args), "negative_downsample": rate, "shard_counts": counts}),
                world, root, full_root, pandas_root, sharded_root,
            )
            if bucketing is not None and counts:
                base = results[name]
                results[name]["bucketing"] = {
                    "buckets": args.buckets, "seconds": round(bucketing["seconds"], 3), "cpu_s": round(bucketing["cpu_s"], 3),
                    "cpu_vs_unsharded": round(bucketing["cpu_s"] / base["cpu_s"]["incremental"], 3),
                }
            print(json.dumps({"config": name, **results[name]}), flush=True)
        # The last line: every config's figures; the headline ones of the benchmark config, as before.
        headline = ("events_per_s", "speedup_vs_pandas", "incremental_vs_full", "peak_rss_mb", "examples_bytes")
        sharding = {
            count: {k: r[k] for k in SHARDING_HEADLINE}
            for count, r in results["benchmark"].get("sharding", {}).items()
        }
        print(json.dumps({**{k: results["benchmark"][k] for k in headline}, "setup_s": round(setup_s, 1),
                          **({"sharding": sharding} if sharding else {}),
                          **({"bucketing": results["benchmark"]["bucketing"]} if "bucketing" in results["benchmark"] else {}),
                          "configs": {name: {k: r[k] for k in (*headline, "negative_downsample")}
                                      for name, r in results.items()}}))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
