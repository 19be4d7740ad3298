"""Unit tests of features.build on a tiny hand-made world of four days, checked against hand-computed values."""

from __future__ import annotations

import datetime as dt
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from core import contracts, storage
from core.contracts import (
    ACTIONS,
    DENSE_FEATURES,
    EMBEDDING_DIM,
    EVENTS_SCHEMA,
    EXAMPLES_SCHEMA,
    PIN_DAILY_SCHEMA,
    PIN_WINDOW_SCHEMA,
    PINS_SCHEMA,
    USER_DAILY_SCHEMA,
    USER_SEQUENCE_SCHEMA,
    USER_WINDOW_SCHEMA,
)
from core.failures import ExitCode
from core.storage import is_complete, partition, read_metadata, read_table, shift_ds, write_table
from features import build, step_io
from features.steps.daily import build_daily
from features.steps.examples import KEEP_NEGATIVE_HASH, _keep_negative, build_examples
from features.steps.sequences import build_sequences
from features.steps.window import DEFAULT_GLOBAL_RATES, build_window
from training.data import read_examples

D1, D2, D3, D4 = "2024-01-01", "2024-01-02", "2024-01-03", "2024-01-04"
DAYS = (D1, D2, D3, D4)
ENGINE = step_io.DuckDBSettings(threads=1, memory_limit="256MB")

# (event_id, impression_id, user_id, pin_id, action, day, "HH:MM")
EVENT_ROWS = [
    (1, 1, 1, 10, "impression", D1, "08:00"),
    (2, 1, 1, 10, "click", D1, "08:01"),
    (3, 3, 2, 10, "impression", D1, "09:00"),
    (4, 3, 2, 10, "click", D1, "09:01"),
    (5, 5, 1, 11, "impression", D1, "10:00"),
    (6, 6, 4, 11, "impression", D1, "11:00"),
    (7, 6, 4, 11, "click", D1, "11:01"),  # user 4 is never seen again
    (8, 8, 1, 11, "impression", D2, "08:00"),
    (9, 8, 1, 11, "repin", D2, "08:02"),
    (10, 10, 1, 12, "impression", D2, "09:00"),
    (11, 10, 1, 12, "hide", D2, "09:01"),
    (12, 12, 1, 10, "impression", D3, "08:00"),
    (13, 12, 1, 10, "closeup", D3, "08:01"),
    (14, 12, 1, 10, "click", D3, "08:02"),
    (15, 15, 1, 13, "impression", D3, "08:00"),
    (16, 15, 1, 13, "click", D3, "08:01"),  # same ts as event 13: the tie is broken by pin_id desc
    (17, 17, 2, 11, "impression", D3, "09:00"),
    (18, 17, 2, 11, "click", D3, "09:05"),
    (19, 19, 1, 12, "impression", D4, "10:00"),
    (20, 19, 1, 12, "click", D4, "10:01"),
    (21, 21, 2, 10, "impression", D4, "11:00"),
    (22, 22, 3, 10, "impression", D4, "12:00"),  # user 3 has no history
    (23, 23, 1, 11, "impression", D4, "13:00"),
]
CATEGORIES = {10: 100, 11: 110, 12: 120, 13: 130}


def ts(day: str, hhmm: str) -> dt.datetime:
    return dt.datetime.fromisoformat(f"{day}T{hhmm}:00+00:00")


def events_table(rows: Sequence[tuple[int, int, int, int, str, str, str]]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "event_id": e,
                "impression_id": i,
                "user_id": u,
                "pin_id": p,
                "action": a,
                "surface": "home_feed",
                "ts": ts(day, hhmm),
            }
            for e, i, u, p, a, day, hhmm in rows
        ],
        schema=EVENTS_SCHEMA,
    )


def pins_table() -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "pin_id": pin,
                "embedding": [0.0] * EMBEDDING_DIM,
                "category": category,
                "creator_id": pin * 1000,
                "created_at": ts("2023-12-01", "00:00"),
            }
            for pin, category in CATEGORIES.items()
        ],
        schema=PINS_SCHEMA,
    )


Row = tuple[int, int, int, int, str, str, str]


def write_events(root: Path, day: str, extra: Sequence[Row] = ()) -> None:
    rows = [r for r in EVENT_ROWS if r[5] == day] + list(extra)
    write_table(root, contracts.RAW_EVENTS, day, events_table(rows))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for day in DAYS:
        write_events(tmp_path, day)
        write_table(tmp_path, contracts.RAW_PINS, day, pins_table())
    return tmp_path


def rows_by(table: pa.Table, key: str) -> dict[int, dict]:
    return {row[key]: row for row in table.to_pylist()}


def build_all(root: Path, **params) -> None:
    for day in DAYS:
        build.build_day(root, day, engine=ENGINE, require_validation=False, **params)


# --- daily ----------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_daily_counts_and_distinct(root: Path) -> None:
    summary = build_daily(root, D1, engine=ENGINE, require_validation=False)

    users = read_table(root, contracts.USER_DAILY, D1)
    pins = read_table(root, contracts.PIN_DAILY, D1)
    assert users.schema.equals(USER_DAILY_SCHEMA) and pins.schema.equals(PIN_DAILY_SCHEMA)
    assert rows_by(users, "user_id")[1] == {
        "user_id": 1,
        "impressions": 2,
        "clicks": 1,
        "repins": 0,
        "hides": 0,
        "closeups": 0,
        "distinct_pins": 2,
        # Engagement per category of the day's pins snapshot (pin 10: category 100, pin 11: 110).
        "categories": [
            {"category": 100, "impressions": 1, "engagements": 1},
            {"category": 110, "impressions": 1, "engagements": 0},
        ],
    }
    assert rows_by(pins, "pin_id")[10] == {
        "pin_id": 10,
        "impressions": 2,
        "clicks": 2,
        "repins": 0,
        "hides": 0,
        "closeups": 0,
        "distinct_users": 2,
    }
    assert summary[contracts.USER_DAILY]["rows"] == 3  # users 1, 2, 4
    assert read_metadata(root, contracts.PIN_DAILY, D1)["inputs"] == [f"raw/events/ds={D1}", f"raw/pins/ds={D1}"]


# --- window ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_window_sums_days_in_window_and_smooths_pin_rates(root: Path) -> None:
    for day in DAYS:
        build_daily(root, day, engine=ENGINE, require_validation=False)
    summary = build_window(root, D4, window_days=3, prior_impressions=20.0, engine=ENGINE, require_validation=False)

    users = read_table(root, contracts.USER_WINDOW, D4)
    pins = read_table(root, contracts.PIN_WINDOW, D4)
    assert users.schema.equals(USER_WINDOW_SCHEMA) and pins.schema.equals(PIN_WINDOW_SCHEMA)
    # D2..D4; D1 (2 impressions, 1 click of user 1) lies outside the window.
    u1 = rows_by(users, "user_id")[1]
    assert (u1["impressions"], u1["clicks"], u1["repins"], u1["hides"], u1["closeups"]) == (6, 3, 1, 1, 1)
    assert u1["ctr"] == pytest.approx(0.5)
    assert u1["categories"] == [
        {"category": 100, "impressions": 1, "engagements": 2},  # D3: closeup + click on pin 10
        {"category": 110, "impressions": 2, "engagements": 1},  # D2 repin, D4 impression only
        {"category": 120, "impressions": 2, "engagements": 2},  # D2 hide, D4 click
        {"category": 130, "impressions": 1, "engagements": 1},
    ]
    assert 4 not in rows_by(users, "user_id")

    # Global over every pin of D2..D4: 9 impressions, 4 clicks, 1 repin, 1 hide.
    g_ctr, g_repin, g_hide = 4 / 9, 1 / 9, 1 / 9
    p10 = rows_by(pins, "pin_id")[10]
    assert (p10["impressions"], p10["clicks"], p10["closeups"]) == (3, 1, 1)
    assert p10["ctr"] == pytest.approx((1 + 20 * g_ctr) / (3 + 20))
    assert p10["repin_rate"] == pytest.approx((0 + 20 * g_repin) / (3 + 20))
    assert p10["hide_rate"] == pytest.approx((0 + 20 * g_hide) / (3 + 20))

    meta = summary[contracts.PIN_WINDOW]
    assert meta["global_rates"] == pytest.approx({"ctr": g_ctr, "repin_rate": g_repin, "hide_rate": g_hide})
    assert meta["missing_days"] == [] and meta["window_start"] == D2
    assert read_metadata(root, contracts.PIN_WINDOW, D4)["global_rates"] == meta["global_rates"]


@pytest.mark.unit
def test_window_builds_missing_daily_from_raw_and_names_days_without_data(root: Path) -> None:
    for day in DAYS:
        build_daily(root, day, engine=ENGINE, require_validation=False)
    build_window(root, D4, window_days=3, engine=ENGINE, require_validation=False)
    expected = {d: read_table(root, d, D4) for d in (contracts.USER_WINDOW, contracts.PIN_WINDOW)}

    # D2's daily aggregates are missing: computed from its raw partitions, same result, nothing written for D2.
    for dataset in (contracts.USER_DAILY, contracts.PIN_DAILY):
        storage.remove_tree(partition(root, dataset, D2))
    summary = build_window(root, D4, window_days=3, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_WINDOW]["computed_from_raw"] == [D2]
    assert summary[contracts.USER_WINDOW]["missing_days"] == []
    assert f"raw/events/ds={D2}" in summary[contracts.PIN_WINDOW]["inputs"]
    assert not storage.exists(partition(root, contracts.USER_DAILY, D2))
    for dataset, table in expected.items():
        assert read_table(root, dataset, D4).equals(table), dataset

    # No raw events of D2 either (a gap): the day is named in missing_days and left out.
    storage.remove_tree(partition(root, contracts.RAW_EVENTS, D2))
    summary = build_window(root, D4, window_days=3, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_WINDOW]["missing_days"] == [D2]
    assert read_metadata(root, contracts.PIN_WINDOW, D4)["missing_days"] == [D2]
    u1 = rows_by(read_table(root, contracts.USER_WINDOW, D4), "user_id")[1]
    assert (u1["impressions"], u1["repins"], u1["hides"]) == (4, 0, 0)


def build_window_days(root: Path, days: Sequence[str], window_days: int) -> dict[str, str]:
    """Daily aggregates and window of each day, in order, as the DAG does; the window's mode by day."""
    modes = {}
    for day in days:
        build_daily(root, day, engine=ENGINE, require_validation=False)
        summary = build_window(root, day, window_days=window_days, engine=ENGINE, require_validation=False)
        modes[day] = summary[contracts.USER_WINDOW]["mode"]
        assert summary[contracts.PIN_WINDOW]["mode"] == modes[day]
    return modes


def assert_window_equals_recompute(root: Path, day: str, window_days: int) -> None:
    expected = {d: read_table(root, d, day) for d in (contracts.USER_WINDOW, contracts.PIN_WINDOW)}
    meta = read_metadata(root, contracts.PIN_WINDOW, day)
    build_window(root, day, window_days=window_days, recompute=True, engine=ENGINE, require_validation=False)
    for dataset, table in expected.items():
        assert read_table(root, dataset, day).equals(table), (dataset, day)
    recomputed = read_metadata(root, contracts.PIN_WINDOW, day)
    for key in ("totals", "global_rates", "missing_days"):
        assert recomputed[key] == meta[key], key


@pytest.mark.unit
def test_window_incremental_equals_full_sum_across_a_missing_day(root: Path) -> None:
    # D2 never lands: D3's window is a full sum (no window of D2); D4's is D3's + D4 - D1, with D2 still missing.
    storage.remove_tree(partition(root, contracts.RAW_EVENTS, D2))
    modes = build_window_days(root, (D1, D3, D4), window_days=3)
    assert modes == {D1: "full", D3: "full", D4: "incremental"}
    meta = read_metadata(root, contracts.USER_WINDOW, D4)
    assert meta["inputs"] == [f"features/user_window/ds={D3}", f"features/user_daily/ds={D4}", f"features/user_daily/ds={D1}"]
    assert meta["missing_days"] == [D2] and sorted(meta["daily_versions"]) == [D3, D4]
    # User 4 (D1 only) left with D1: its row reached zero and is gone, as in the full sum.
    assert 4 not in rows_by(read_table(root, contracts.USER_WINDOW, D4), "user_id")
    assert_window_equals_recompute(root, D4, window_days=3)

    # D2 lands late: its days' windows must include it, so D4's window is a full sum again.
    write_events(root, D2)
    build_window(root, D3, window_days=3, engine=ENGINE, require_validation=False)
    summary = build_window(root, D4, window_days=3, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_WINDOW]["mode"] == "full"  # D3's window computed D2 from raw
    assert_window_equals_recompute(root, D4, window_days=3)


@pytest.mark.unit
def test_window_is_a_full_sum_when_a_summed_day_was_rebuilt_or_parameters_differ(root: Path) -> None:
    assert build_window_days(root, DAYS, window_days=2) == {D1: "full", D2: "incremental", D3: "incremental", D4: "incremental"}
    # D3's daily aggregates are rebuilt from changed raw events after D3's window summed them.
    write_events(root, D3, extra=[(24, 17, 2, 11, "repin", D3, "09:10")])
    build_daily(root, D3, engine=ENGINE, require_validation=False)
    summary = build_window(root, D4, window_days=2, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_WINDOW]["mode"] == "full"
    assert "rebuilt" in summary[contracts.USER_WINDOW]["mode_reason"]
    # One reason for both windows, naming both (the pin window's named the user window alone).
    assert summary[contracts.PIN_WINDOW]["mode_reason"] == summary[contracts.USER_WINDOW]["mode_reason"]
    assert f"since the windows of {D3} were built" in summary[contracts.PIN_WINDOW]["mode_reason"]
    assert_window_equals_recompute(root, D4, window_days=2)
    summary = build_window(root, D4, window_days=3, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_WINDOW]["mode"] == "full"
    assert "window_days=2, not 3" in summary[contracts.USER_WINDOW]["mode_reason"]


# --- sequences ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_sequences_most_recent_first_truncated_and_windowed(root: Path) -> None:
    summary = build_sequences(root, D4, sequence_length=3, window_days=2, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_SEQUENCE]["mode"] == "full"
    assert summary[contracts.USER_SEQUENCE]["missing_days"] == []

    table = read_table(root, contracts.USER_SEQUENCE, D4)
    assert table.schema.equals(USER_SEQUENCE_SCHEMA)
    seqs = rows_by(table, "user_id")
    # User 1 in D3..D4: click 12 (D4 10:01), click 10 (D3 08:02), click 13 and closeup 10 (both D3 08:01,
    # pin 13 first); truncated to 3. Impressions and D2's repin/hide are not there.
    assert seqs[1]["seq_pin_ids"] == [12, 10, 13]
    assert seqs[1]["seq_actions"] == [ACTIONS.index("click")] * 3
    assert seqs[1]["seq_categories"] == [120, 100, 130]
    assert seqs[1]["seq_ts"] == [ts(D4, "10:01"), ts(D3, "08:02"), ts(D3, "08:01")]
    assert seqs[2]["seq_pin_ids"] == [11]  # user 2's D1 click is older than the window
    assert set(seqs) == {1, 2}  # user 4 (D1 only) and user 3 (impressions only) have no sequence


@pytest.mark.unit
def test_sequences_incremental_equals_full_recompute(root: Path) -> None:
    incremental = {}
    for day in DAYS:
        summary = build_sequences(root, day, sequence_length=2, window_days=2, engine=ENGINE, require_validation=False)
        assert summary[contracts.USER_SEQUENCE]["mode"] == ("full" if day == D1 else "incremental")
        incremental[day] = read_table(root, contracts.USER_SEQUENCE, day)

    for day in (D4, D3, D2):
        storage.remove_tree(partition(root, contracts.USER_SEQUENCE, shift_ds(day, -1)))
        summary = build_sequences(root, day, sequence_length=2, window_days=2, engine=ENGINE, require_validation=False)
        assert summary[contracts.USER_SEQUENCE]["mode"] == "full"
        assert read_table(root, contracts.USER_SEQUENCE, day).equals(incremental[day]), day

    # D3 truncation dropped closeup 10 at the tie; D2's actions left the window at D4.
    assert rows_by(incremental[D4], "user_id")[1]["seq_pin_ids"] == [12, 10]
    assert 4 not in rows_by(incremental[D3], "user_id")


@pytest.mark.unit
def test_sequences_recompute_when_parameters_change(root: Path) -> None:
    build_sequences(root, D3, sequence_length=2, window_days=2, engine=ENGINE, require_validation=False)
    summary = build_sequences(root, D4, sequence_length=3, window_days=2, engine=ENGINE, require_validation=False)
    assert summary[contracts.USER_SEQUENCE]["mode"] == "full"


# --- examples -------------------------------------------------------------------------------------------

FEATURE_COLUMNS = [
    "category",
    "creator_id",
    *DENSE_FEATURES,
    "seq_pin_ids",
    "seq_actions",
    "seq_categories",
    "seq_age_hours",
]


@pytest.mark.unit
def test_examples_labels_features_of_previous_day_and_cold_start(root: Path) -> None:
    build_all(root, window_days=2, sequence_length=3)

    stored = read_table(root, contracts.EXAMPLES, D4)
    assert stored.schema.equals(EXAMPLES_SCHEMA)
    # The sequence is stored by reference: the day of the sequences (D3) and how many of the user's actions.
    assert set(stored["seq_ds"].to_pylist()) == {dt.date.fromisoformat(D3)}
    assert stored["seq_len"].to_pylist() == [3, 1, 0, 3]
    table = read_examples(root, D4)  # as training reads it: the references resolved into the lists
    assert table.schema.equals(contracts.RESOLVED_EXAMPLES_SCHEMA)
    assert table["impression_id"].to_pylist() == [19, 21, 22, 23]
    rows = rows_by(table, "impression_id")
    assert [rows[i]["click"] for i in (19, 21, 22, 23)] == [1, 0, 0, 0]
    assert all(rows[i][label] == 0 for i in rows for label in ("repin", "hide"))

    # Impression 19: user 1 at D4 10:00, features as of the end of D3 (window D2..D3).
    ex = rows[19]
    assert (ex["category"], ex["creator_id"]) == (120, 12000)
    assert (ex["u_impressions"], ex["u_clicks"], ex["u_repins"], ex["u_hides"]) == (4.0, 2.0, 1.0, 1.0)
    assert ex["u_ctr"] == pytest.approx(0.5)
    p_window = rows_by(read_table(root, contracts.PIN_WINDOW, D3), "pin_id")[12]
    assert ex["p_impressions"] == 1.0 and ex["p_hide_rate"] == pytest.approx(p_window["hide_rate"])
    # The sequence of D3 (D4's click on pin 12 at 10:01 is not in it).
    assert ex["seq_pin_ids"] == [10, 13, 10]
    assert ex["seq_actions"] == [1, 1, 4]
    assert ex["seq_age_hours"] == pytest.approx([25 + 58 / 60, 25 + 59 / 60, 25 + 59 / 60], rel=1e-6)

    # Impression 22: user 3 has no history: zeros, ctr 0 and an empty sequence.
    cold = rows[22]
    assert all(cold[f] == 0.0 for f in DENSE_FEATURES if f.startswith("u_"))
    assert cold["seq_pin_ids"] == [] and cold["seq_age_hours"] == []

    meta = read_metadata(root, contracts.EXAMPLES, D4)
    assert meta["missing_inputs"] == [] and meta["features_ds"] == D3
    assert meta["global_rates_source"] == f"features/pin_window/ds={D3}"


@pytest.mark.unit
def test_examples_ignore_events_of_their_own_day(root: Path) -> None:
    build_all(root, window_days=2, sequence_length=3)
    before = read_examples(root, D4)
    features_d3 = {d: read_table(root, d, D3) for d in (contracts.USER_WINDOW, contracts.USER_SEQUENCE)}

    # An extra click of user 2 on pin 10 during D4, before impression 21 (11:00) and under its id.
    write_events(root, D4, extra=[(24, 21, 2, 10, "click", D4, "10:30")])
    build.build_day(root, D3, window_days=2, sequence_length=3, engine=ENGINE, require_validation=False)
    build.build_day(root, D4, window_days=2, sequence_length=3, engine=ENGINE, require_validation=False)

    for dataset, table in features_d3.items():
        assert read_table(root, dataset, D3).equals(table)
    after = read_examples(root, D4)
    assert after.select(["impression_id", *FEATURE_COLUMNS]).equals(before.select(["impression_id", *FEATURE_COLUMNS]))
    assert rows_by(after, "impression_id")[21]["click"] == 1
    assert rows_by(before, "impression_id")[21]["click"] == 0


@pytest.mark.unit
def test_examples_without_previous_features_use_priors_and_record_missing(root: Path) -> None:
    summary = build_examples(root, D1, engine=ENGINE, require_validation=False)[contracts.EXAMPLES]
    prev = "2023-12-31"
    assert summary["missing_inputs"] == [
        f"features/user_window/ds={prev}",
        f"features/pin_window/ds={prev}",
        f"features/user_sequence/ds={prev}",
    ]
    assert summary["global_rates_source"] == "defaults"
    table = read_table(root, contracts.EXAMPLES, D1)
    assert table.schema.equals(EXAMPLES_SCHEMA)
    assert set(table["p_ctr"].to_pylist()) == {DEFAULT_GLOBAL_RATES["ctr"]}
    assert set(table["seq_len"].to_pylist()) == {0} and summary["sequence_digest"] is None
    assert set(map(len, read_examples(root, D1)["seq_pin_ids"].to_pylist())) == {0}
    assert table["click"].to_pylist() == [1, 1, 0, 1]


@pytest.mark.unit
def test_negative_downsampling_keeps_positives_and_is_deterministic(root: Path) -> None:
    positives = {1, 3, 6}  # D1 impressions with a click; impression 5 is the only negative
    zero = build_examples(root, D1, negative_downsample=0.0, engine=ENGINE, require_validation=False)[contracts.EXAMPLES]
    assert set(read_table(root, contracts.EXAMPLES, D1)["impression_id"].to_pylist()) == positives
    assert zero["negative_downsample"] == 0.0 and zero["impressions"] == 4 and zero["rows"] == 3

    for seed in (0, 1, 2, 3):
        build_examples(root, D1, negative_downsample=0.5, seed=seed, engine=ENGINE, require_validation=False)
        first = read_table(root, contracts.EXAMPLES, D1)
        build_examples(root, D1, negative_downsample=0.5, seed=seed, engine=ENGINE, require_validation=False)
        assert read_table(root, contracts.EXAMPLES, D1).equals(first)
        digest = hashlib.md5(f"{seed}:5".encode()).hexdigest()
        kept_5 = int(digest[:13], 16) / 2**52 < 0.5
        assert set(first["impression_id"].to_pylist()) == positives | ({5} if kept_5 else set())


@pytest.mark.unit
def test_a_steps_last_query_closes_its_connection_once_read_and_writes_every_row(tmp_path: Path) -> None:
    import duckdb

    schema = pa.schema([pa.field("user_id", pa.int64(), nullable=False)])
    rows = 3 * step_io.BATCH_ROWS + 5  # several batches: the last still encodes when the connection closes
    with step_io.connect(ENGINE) as con:
        summary = step_io.write_query(
            con, f"SELECT range AS user_id FROM range({rows}) ORDER BY user_id", None, tmp_path, "features/last_query",
            D1, schema, {"inputs": []}, late_metadata=lambda: {"counted": con.sql("SELECT 42").fetchall()[0][0]},
            last_query=True,
        )
        with pytest.raises(duckdb.ConnectionException):
            con.execute("SELECT 1")
    assert summary["rows"] == rows and summary["counted"] == 42  # late_metadata ran before the close
    assert read_table(tmp_path, "features/last_query", D1)["user_id"].to_pylist() == list(range(rows))


def _hold_encoding(monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> threading.Event:
    """Hold the encoding of every output's files until the returned event is set (and fail the files of ``fail``)."""
    release = threading.Event()
    encode = step_io._ParquetFiles._encode

    def held(files: step_io._ParquetFiles, path: str, tables: list[pa.Table]) -> None:
        assert release.wait(60)
        if fail and f"/{fail}/" in path:
            raise OSError(28, "No space left on device", path)
        encode(files, path, tables)

    monkeypatch.setattr(step_io._ParquetFiles, "_encode", held)
    return release


def _write_range(con: Any, root: Path, dataset: str, rows: int) -> dict[str, Any]:
    schema = pa.schema([pa.field("user_id", pa.int64(), nullable=False)])
    sql = f"SELECT range AS user_id FROM range({rows}) ORDER BY user_id"
    return step_io.write_query(con, sql, None, root, dataset, D1, schema, {"inputs": []})


@pytest.mark.unit
def test_overlapped_outputs_run_the_next_query_while_files_encode_and_publish_every_output_by_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _hold_encoding(monkeypatch)
    with step_io.connect(ENGINE) as con, step_io.overlapped_outputs():
        first = _write_range(con, tmp_path, "features/first", 1000)
        # Returned with its files still held: not published yet, and the next query runs.
        assert first["rows"] == 1000 and not is_complete(tmp_path, "features/first", D1)
        with step_io.overlapped_outputs():  # nested: joins the outer block (published at its end, not this one's)
            second = _write_range(con, tmp_path, "features/second", 10)
        assert not is_complete(tmp_path, "features/second", D1)
        release.set()
    assert second["rows"] == 10
    assert read_table(tmp_path, "features/first", D1)["user_id"].to_pylist() == list(range(1000))
    assert read_table(tmp_path, "features/second", D1)["user_id"].to_pylist() == list(range(10))
    # Outside a block, an output is published when write_query returns.
    release.clear()
    threading.Timer(0.2, release.set).start()
    with step_io.connect(ENGINE) as con:
        _write_range(con, tmp_path, "features/third", 5)
    assert is_complete(tmp_path, "features/third", D1)


@pytest.mark.unit
def test_a_failed_overlapped_output_is_raised_at_the_end_and_neither_it_nor_the_next_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with step_io.connect(ENGINE) as con:
        _write_range(con, tmp_path, "features/second", 10)  # an older version
    release = _hold_encoding(monkeypatch, fail="features/second")
    with pytest.raises(OSError, match="No space left"), step_io.connect(ENGINE) as con, step_io.overlapped_outputs():
        _write_range(con, tmp_path, "features/first", 100)
        _write_range(con, tmp_path, "features/second", 20)
        _write_range(con, tmp_path, "features/third", 30)
        release.set()
    assert read_table(tmp_path, "features/first", D1).num_rows == 100  # finished before the failure
    assert read_table(tmp_path, "features/second", D1).num_rows == 10  # the old version stays
    assert not storage.exists(partition(tmp_path, "features/third", D1))
    assert not [p.name for p in (tmp_path / "features").rglob(".tmp-*")]  # no staging folder left


@pytest.mark.unit
@pytest.mark.parametrize("rate", [0.2, 0.5, 1e-3, 0.999999, 1 - 2**-53, 1.0, 0.0, 2**-52, 0.1 + 2**-40])
def test_the_sampling_condition_keeps_exactly_the_impressions_of_the_documented_hash(rate: float) -> None:
    """The SQL compares md5 hex strings; it must keep exactly those with int(md5[:13], 16) / 2^52 < rate."""
    import duckdb

    ids = list(range(-50, 20_000)) + [2**62 + 7, 10**15]
    seed = 7
    expected = {i for i in ids if int(hashlib.md5(f"{seed}:{i}".encode()).hexdigest()[:13], 16) / 2**52 < rate}
    condition, params = _keep_negative(rate, seed)
    with duckdb.connect() as con:
        con.register("i", pa.table({"impression_id": pa.array(ids, pa.int64())}))
        rows = con.execute(f"SELECT impression_id FROM i WHERE {condition}", params or None).fetchall()
    assert {r[0] for r in rows} == expected
    assert (condition != KEEP_NEGATIVE_HASH) == (rate in (1 - 2**-53, 1.0, 0.0))  # no md5 where none is needed


# --- validation -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_build_needs_a_passed_validation_report_for_the_current_contents(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from core.config import ValidationConfig
    from features.validation.partition import validate_partition
    from features.validation.report import RESULT_FILE, report_dir

    command = f"python -m features.validate events --root {root} --ds {D1}"
    with pytest.raises(step_io.UnvalidatedInputError, match=rf"raw/events/ds={D1} .*has not been validated") as err:
        build_daily(root, D1, engine=ENGINE)
    assert command in str(err.value) and "--skip-validation" in str(err.value)
    assert not storage.exists(partition(root, contracts.USER_DAILY, D1))

    for dataset in ("events", "pins"):
        report = validate_partition(root, dataset, D1, config=ValidationConfig(), data_docs=False)
        assert report.success, report.failure_message()
    summary = build_daily(root, D1, engine=ENGINE)[contracts.USER_DAILY]
    recorded = storage.read_json(storage.join(report_dir(root, "events", D1), RESULT_FILE))["fingerprint"]
    assert summary["skip_validation"] is False
    assert summary["validated_inputs"][f"raw/events/ds={D1}"] == recorded

    # The partition is replaced after it passed (one more event): refused until validated again.
    write_events(root, D1, extra=[(24, 5, 1, 11, "click", D1, "10:05")])
    with pytest.raises(step_io.UnvalidatedInputError, match="contents changed since it passed validation"):
        build_examples(root, D1, engine=ENGINE)
    assert build.main(["--root", str(root), "--ds", D1, "--step", "examples"]) == ExitCode.DATA
    assert command in capsys.readouterr().err
    assert build.main(["--root", str(root), "--ds", D1, "--step", "examples", "--skip-validation"]) == 0
    assert read_metadata(root, contracts.EXAMPLES, D1)["skip_validation"] is True
    assert "validated_inputs" not in read_metadata(root, contracts.EXAMPLES, D1)


@pytest.mark.unit
def test_a_checked_build_refuses_features_built_without_validation_and_an_unchecked_one_records_them(
    root: Path,
) -> None:
    """A day built with --skip-validation: the next day's checked build would read its features and record
    skip_validation false (validated) for outputs that are not; it is refused, naming them, and a build with
    --skip-validation records them as unvalidated_inputs (which the day after inherits in turn)."""
    from core.config import ValidationConfig
    from features.validation.partition import validate_partition

    build.build_day(root, D1, window_days=2, sequence_length=3, engine=ENGINE, require_validation=False)
    for dataset in ("events", "pins"):
        assert validate_partition(root, dataset, D2, config=ValidationConfig(), data_docs=False).success
    build_daily(root, D2, engine=ENGINE)  # reads raw partitions only: validated
    with pytest.raises(step_io.UnvalidatedInputError, match=rf"features/user_window/ds={D1} was built from raw "
                       r"partitions without a passed validation \(--skip-validation\).*or build this day with "
                       "--skip-validation as well"):
        build_window(root, D2, window_days=2, engine=ENGINE)
    with pytest.raises(step_io.UnvalidatedInputError, match=rf"features/user_sequence/ds={D1}"):
        build_sequences(root, D2, sequence_length=3, window_days=2, engine=ENGINE)
    assert not storage.exists(partition(root, contracts.USER_WINDOW, D2))

    build.build_day(root, D2, window_days=2, sequence_length=3, engine=ENGINE, require_validation=False)
    examples = read_metadata(root, contracts.EXAMPLES, D2)
    assert examples["features_window_days"] == 2  # the window of the features it joined (D1's)
    assert examples["skip_validation"] is True and f"features/user_window/ds={D1}" in examples["unvalidated_inputs"]
    build.build_day(root, D3, window_days=2, sequence_length=3, engine=ENGINE, require_validation=False)
    assert f"features/user_sequence/ds={D2}" in read_metadata(root, contracts.USER_SEQUENCE, D3)["unvalidated_inputs"]


@pytest.mark.unit
def test_a_rewrite_that_keeps_the_size_and_the_footer_changes_the_fingerprint(tmp_path: Path) -> None:
    import os
    import shutil
    import time

    import pyarrow.parquet as pq

    from features.validation.report import content_fingerprint

    folder, file = tmp_path / "ds=2026-01-01", tmp_path / "ds=2026-01-01" / "part-00000.parquet"
    folder.mkdir()

    def write(ids: list[int]) -> bytes:  # uncompressed, plain: a middle value changed keeps every byte count
        pq.write_table(pa.table({"event_id": pa.array(ids, pa.int64())}), str(file) + ".new", compression="NONE",
                       use_dictionary=False)
        os.replace(str(file) + ".new", file)
        data = file.read_bytes()
        return data[-8 - int.from_bytes(data[-8:-4], "little"):]

    footer = write([1, 5, 3, 9])
    before = content_fingerprint(folder)
    size = file.stat().st_size
    time.sleep(0.02)  # a rewrite comes after the validated write: past the file clock's tick (1-10 ms by kernel)
    assert write([1, 5, 5, 9]) == footer and file.stat().st_size == size  # a duplicated id, the same footer
    assert content_fingerprint(folder) != before
    copy = tmp_path / "copy" / "ds=2026-01-01"
    shutil.copytree(folder, copy)  # copy2 keeps the write stamp: the same contents, the same fingerprint
    assert content_fingerprint(copy) == content_fingerprint(folder)


# --- errors and CLI -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_missing_events_partition_names_the_day(root: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"raw/events for ds=2024-01-05"):
        build_daily(root, "2024-01-05", engine=ENGINE, require_validation=False)
    with pytest.raises(step_io.MissingInputError, match=r"--step daily --ds 2024-01-05"):
        build_window(root, "2024-01-05", engine=ENGINE, require_validation=False)


@pytest.mark.unit
def test_a_quarantined_input_is_named_with_its_record(root: Path) -> None:
    from features.validation.report import quarantine_root

    record = Path(quarantine_root(root, "events", "2024-01-05")) / "20240106T000000Z"
    (record / "data").mkdir(parents=True)
    with pytest.raises(step_io.MissingInputError, match=rf"raw/events for ds=2024-01-05 was quarantined by its "
                       rf"validation \({record}: its data and report\); land a fixed partition"):
        build_daily(root, "2024-01-05", engine=ENGINE, require_validation=False)


@pytest.mark.unit
def test_cli_prints_summary_and_exits_data_on_missing_input(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build.main(["--root", str(root), "--ds", D1, "--step", "daily", "--skip-validation"]) == 0
    assert '"features/user_daily"' in capsys.readouterr().out
    assert build.main(["--root", str(root), "--ds", "2024-02-01"]) == ExitCode.DATA
    assert "ds=2024-02-01" in capsys.readouterr().err


@pytest.mark.unit
def test_a_full_disk_exits_infra_naming_it_and_keeps_the_published_partition(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--root", str(root), "--ds", D1, "--step", "daily", "--skip-validation"]
    assert build.main(argv) == 0
    before = read_table(root, contracts.USER_DAILY, D1)
    folder = Path(partition(root, contracts.USER_DAILY, D1)).parent
    entries = sorted(p.name for p in folder.iterdir())

    def full_disk(*_args: object, **_kwargs: object) -> pa.Table:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(step_io, "conform", full_disk)
    capsys.readouterr()
    assert build.main(argv) == ExitCode.INFRA  # retried by the task, not failed as a bug
    err = capsys.readouterr().err
    assert "INFRA error" in err and f"the disk is full: free space under the storage root {root}" in err
    assert read_table(root, contracts.USER_DAILY, D1).equals(before)
    assert sorted(p.name for p in folder.iterdir()) == entries  # no half-written copy left beside it
