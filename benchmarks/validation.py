"""Benchmark of the validation gate on one day of raw events, next to the time to just read that day.

    .venv/bin/python benchmarks/validation.py                    # >= 2M events
    .venv/bin/python benchmarks/validation.py --events 300000    # a quick run

Setup (not timed): a synthetic world of one day (``features.synthetic``), tiled with shifted user and
event ids until the day has at least ``--events`` events (the pins snapshot is shared, the users
snapshot tiled), so that every check (referential integrity, engagement linkage, uniqueness) sees a
realistic day; plus ``--history`` earlier days (copies shifted back by whole days) validated once, so the
history checks compare rather than warn. Great Expectations is imported before timing.

Measured in the same process, alternating, ``--repeat`` times each (the best of each is reported):

* ``read`` — reading the partition's Parquet files into one Arrow table (``pyarrow.parquet``);
* ``validate`` — ``validate_partition`` without Data Docs (default thresholds, ``core.config.ValidationConfig``):
  read, schema, derived columns, the GX suite, profile and history checks, report written;
* ``validate_docs`` — the same with the GX Data Docs HTML rendered (once).

The last line printed is one JSON object with ``events``, the seconds of each phase, ``events_per_s`` of
validation and of the read, and ``ratio`` = validate seconds / read seconds (the aim: at most 5). Also:
``validate_first_s``, the first validation of the process (it builds the GX context the later ones reuse,
``features.validation.suite``), and ``cpu_ratio``, the same ratio in CPU seconds of the process (all threads:
the read decodes columns on several, the validation profiles the day beside the suite).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from core import contracts, storage  # noqa: E402
from core.config import ValidationConfig  # noqa: E402
from features import validate  # noqa: E402
from features.synthetic import EVENT_ID_DAY_STRIDE, WorldConfig, generate_world  # noqa: E402
from features.validation.suite import quiet_gx  # noqa: E402

DS = "2026-11-20"
CONFIG = ValidationConfig()


def _shift_events(table: pa.Table, copy: int, users: int, days: int = 0) -> pa.Table:
    """Copy ``copy`` of a day: user ids moved past the previous copies; ids and times moved ``days`` days."""
    per_copy = EVENT_ID_DAY_STRIDE // 64  # room for each copy's ids inside the day's id range
    id_shift = copy * per_copy + days * EVENT_ID_DAY_STRIDE
    ts = table.column("ts").cast(pa.int64()).to_numpy() + days * 86_400_000_000
    return pa.table(
        {
            "event_id": pc.add(table.column("event_id"), id_shift),
            "impression_id": pc.add(table.column("impression_id"), id_shift),
            "user_id": pc.add(table.column("user_id"), copy * users),
            "pin_id": table.column("pin_id"),
            "action": table.column("action"),
            "surface": table.column("surface"),
            "ts": pa.array(ts, pa.int64()).cast(contracts.TS),
        },
        schema=contracts.EVENTS_SCHEMA,
    )


def _tile_users(table: pa.Table, copies: int, users: int) -> pa.Table:
    return pa.concat_tables(
        [table.set_column(0, table.schema.field(0), pc.add(table.column("user_id"), c * users)) for c in range(copies)]
    )


def setup(root: Path, events: int, history: int, users: int) -> int:
    """Write the benchmark day and its history under ``root``; return the day's event count."""
    src = root / "_source"
    generate_world(src, WorldConfig(start=DS, days=1, users=users, pins=max(3000, users // 4), seed=5))
    day = storage.read_table(src, "raw/events", DS)
    copies = max(1, -(-events // day.num_rows))
    tiled = pa.concat_tables([_shift_events(day, c, users) for c in range(copies)])
    pins = storage.read_table(src, "raw/pins", DS)
    people = _tile_users(storage.read_table(src, "raw/users", DS), copies, users)
    shutil.rmtree(src)
    for back in range(history, -1, -1):
        ds = storage.shift_ds(DS, -back)
        table = tiled if back == 0 else pa.concat_tables(
            [_shift_events(day, c, users, -back) for c in range(copies)]
        )
        # Row groups as an upstream writer would make them; the read and the validation read the same files.
        with storage.write_partition(root, "raw/events", ds) as staging:
            with storage.open_output(storage.join(staging, storage.DATA_FILE)) as sink:
                pq.write_table(table, sink, row_group_size=256 * 1024)
        storage.write_table(root, "raw/pins", ds, pins)
        storage.write_table(root, "raw/users", ds, people)
    for back in range(history, 0, -1):
        report = validate.validate_partition(
            root, "events", storage.shift_ds(DS, -back), config=CONFIG, data_docs=False
        )
        assert report.success, report.failure_message()
    return tiled.num_rows


def read_once(root: Path) -> tuple[float, float, int]:
    """Wall and CPU seconds of a plain read of the day, and its rows."""
    started, cpu = time.perf_counter(), time.process_time()
    files = storage.data_files(root, "raw/events", DS)
    table = pa.concat_tables([storage.read_parquet(f) for f in files])
    return time.perf_counter() - started, time.process_time() - cpu, table.num_rows


def validate_once(root: Path, data_docs: bool) -> tuple[float, float]:
    """Wall and CPU seconds of validating the day."""
    started, cpu = time.perf_counter(), time.process_time()
    report = validate.validate_partition(root, "events", DS, config=CONFIG, data_docs=data_docs)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert report.success, report.failure_message()
    return elapsed, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=2_000_000, help="events in the day (at least)")
    parser.add_argument("--users", type=int, default=20_000, help="users of the synthetic world before tiling")
    parser.add_argument("--history", type=int, default=3, help="validated days before the day")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each measurement (best reported)")
    parser.add_argument(
        "--keep", type=Path, default=None, help="write the setup here and keep it; reused when it is there already"
    )
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="pinflow-bench-validation-"))
    try:
        t0 = time.perf_counter()
        if args.keep is not None and storage.is_complete(root, "raw/events", DS):  # reuse a kept setup
            with storage.parquet_file(storage.data_files(root, "raw/events", DS)[0]) as parquet:
                events = parquet.metadata.num_rows
        else:
            events = setup(root, args.events, args.history, args.users)
        setup_s = time.perf_counter() - t0
        quiet_gx()
        read_s, validate_s, read_cpu, validate_cpu = [], [], [], []
        for _ in range(args.repeat):
            seconds, cpu, rows = read_once(root)
            assert rows == events
            read_s.append(seconds)
            read_cpu.append(cpu)
            seconds, cpu = validate_once(root, data_docs=False)
            validate_s.append(seconds)
            validate_cpu.append(cpu)
        docs_s, _ = validate_once(root, data_docs=True)
        result = {
            "benchmark": "validation",
            "events": events,
            "setup_s": round(setup_s, 2),
            "read_s": round(min(read_s), 4),
            "validate_s": round(min(validate_s), 3),
            "validate_first_s": round(validate_s[0], 3),
            "validate_docs_s": round(docs_s, 3),
            "read_events_per_s": round(events / min(read_s)),
            "events_per_s": round(events / min(validate_s)),
            "ratio": round(min(validate_s) / min(read_s), 2),
            "ratio_with_docs": round(docs_s / min(read_s), 2),
            "read_cpu_s": round(min(read_cpu), 4),
            "validate_cpu_s": round(min(validate_cpu), 3),
            "cpu_ratio": round(min(validate_cpu) / min(read_cpu), 2),
            "aim_ratio": 5.0,
            "all_read_s": [round(s, 4) for s in read_s],
            "all_validate_s": [round(s, 3) for s in validate_s],
            "numpy": np.__version__,
        }
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
