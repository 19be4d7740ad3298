"""What makes validating a day cheap must not change a verdict: the GX context kept per process (keyed by the
suite's content), the in-order shortcut of the uniqueness condition, and the day before read only when needed."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from core import contracts, storage
from core.config import ValidationConfig
from features import validate
from features.validation import derived, suite

pytestmark = pytest.mark.unit

DS = "2024-05-01"
START = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
N = 12
CONFIG = ValidationConfig()


def events_table(n: int = N, **overrides: list) -> pa.Table:
    """``n`` valid events of DS: every third row an impression, the two after it its engagements."""
    columns = {
        "event_id": [i + 1 for i in range(n)],
        "impression_id": [i - i % 3 + 1 for i in range(n)],
        "user_id": [1 + (i // 3) % 4 for i in range(n)],
        "pin_id": [100 + (i // 3) % 5 for i in range(n)],
        "action": ["impression" if i % 3 == 0 else contracts.ENGAGEMENTS[i % 4] for i in range(n)],
        "surface": [contracts.SURFACES[(i // 3) % len(contracts.SURFACES)] for i in range(n)],
        "ts": [START + dt.timedelta(minutes=i) for i in range(n)],
    }
    columns.update(overrides)
    return pa.table(columns, schema=contracts.EVENTS_SCHEMA)


def write_day(root: Path, events: pa.Table) -> None:
    storage.write_table(root, "raw/events", DS, events)
    storage.write_table(
        root,
        "raw/pins",
        DS,
        pa.table(
            {
                "pin_id": [100 + i for i in range(N)],
                "embedding": [[float(i)] * contracts.EMBEDDING_DIM for i in range(N)],
                "category": [i % 3 for i in range(N)],
                "creator_id": [1 + i % 2 for i in range(N)],
                "created_at": [START - dt.timedelta(days=i) for i in range(N)],
                "image_embedding": [[float(i) / N] * contracts.IMAGE_DIM for i in range(N)],
                "text_tokens": [[i % contracts.TEXT_VOCAB, 7] for i in range(N)],
            },
            schema=contracts.PINS_SCHEMA,
        ),
    )
    storage.write_table(
        root,
        "raw/users",
        DS,
        pa.table(
            {
                "user_id": [1 + i for i in range(N)],
                "country": ["US" if i % 2 else "FR" for i in range(N)],
                "created_at": [START - dt.timedelta(days=i) for i in range(N)],
            },
            schema=contracts.USERS_SCHEMA,
        ),
    )


def run(root: Path, config: ValidationConfig = CONFIG) -> validate.ValidationReport:
    return validate.validate_partition(root, "events", DS, config=config, data_docs=False)


def failed(report: validate.ValidationReport) -> list[str]:
    return [c.name for c in report.failed_checks]


def test_a_reused_suite_still_catches_a_bad_partition_after_a_good_one(tmp_path: Path) -> None:
    suite.clear_cache()
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_day(good, events_table())
    actions = ["impression", "like", "click"] * (N // 3)  # "like" is no action
    write_day(bad, events_table(event_id=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11], action=actions))

    assert run(good).success
    [kept] = suite._RUNNERS.values()
    report = run(bad)
    assert suite._RUNNERS and list(suite._RUNNERS.values()) == [kept]  # the same context judged both

    assert failed(report) == ["event_id.unique", "action.in_set"]
    unique = next(c for c in report.checks if c.name == "event_id.unique")
    assert unique.observed["unexpected_count"] == 2 and unique.observed["examples"] == [11]
    assert run(good).success  # and the good one passes again after it


def test_a_changed_suite_is_not_served_from_a_stale_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.clear_cache()
    write_day(tmp_path, events_table())
    assert run(tmp_path).success

    # The suite's code changes in this process (as a new closed set would): the new suite judges the partition.
    monkeypatch.setitem(suite.IN_SET, "events", {**suite.IN_SET["events"], "action": ("impression",)})
    report = run(tmp_path)
    assert failed(report) == ["action.in_set"]
    assert len(suite._RUNNERS) == 2
    monkeypatch.undo()
    assert run(tmp_path).success

    # Thresholds are suite content too: another embedding_dim or referential threshold is another suite.
    strict = ValidationConfig(min_referential_integrity=1.0)
    assert run(tmp_path, strict).success
    assert len(suite._RUNNERS) == 3


def test_the_context_cache_is_bounded(tmp_path: Path) -> None:
    suite.clear_cache()
    write_day(tmp_path, events_table())
    for i in range(suite._MAX_RUNNERS + 2):  # another threshold: another suite
        assert run(tmp_path, ValidationConfig(min_referential_integrity=0.9 + i / 100)).success
    assert len(suite._RUNNERS) == suite._MAX_RUNNERS


@pytest.mark.parametrize(
    "event_id",
    [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 12],  # in order, with a repeat: not strictly increasing
        [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 12],  # out of order
    ],
)
def test_the_uniqueness_shortcut_only_answers_strictly_increasing_ids(tmp_path: Path, event_id: list[int]) -> None:
    from great_expectations.expectations import registry
    from great_expectations.expectations.expectation import Expectation

    providers = registry._registered_metrics["column_values.unique.condition"]["providers"]
    before = dict(providers)
    configuration = Expectation.__dict__["configuration"]
    write_day(tmp_path, events_table(event_id=event_id, impression_id=event_id, action=["impression"] * N))

    report = run(tmp_path)

    unique = next(c for c in report.checks if c.name == "event_id.unique")
    assert unique.success is False and unique.observed["unexpected_count"] == 2
    assert providers == before  # GX's own condition is back after the run
    assert Expectation.__dict__["configuration"] is configuration


def test_runs_on_threads_judge_alike_and_leave_gx_as_it_was(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from great_expectations.expectations import registry
    from great_expectations.expectations.expectation import Expectation

    providers = registry._registered_metrics["column_values.unique.condition"]["providers"]
    before, configuration = dict(providers), Expectation.__dict__["configuration"]
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_day(good, events_table())
    write_day(bad, events_table(event_id=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11]))
    suite.clear_cache()

    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(run, [good, bad] * 4))

    assert [failed(r) for r in reports] == [[], ["event_id.unique"]] * 4
    assert providers == before and Expectation.__dict__["configuration"] is configuration


def test_unique_condition_matches_pandas() -> None:
    import pandas as pd

    rng = np.random.default_rng(3)
    for values in (
        np.arange(10),
        np.array([], dtype=np.int64),
        np.array([5]),
        rng.integers(0, 20, 30),
        np.sort(rng.integers(0, 50, 30)),
        rng.normal(size=10),
    ):
        column = pd.Series(values, index=rng.permutation(len(values)) * 2, name="event_id")
        expected = ~column.duplicated(keep=False)
        pd.testing.assert_series_equal(suite._unique_condition(None, column), expected)


def test_the_day_before_is_read_only_for_an_impression_the_day_does_not_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    late_impressions = derived.late_impressions

    def counted(root: storage.Location, ds: str, minutes: float) -> pa.Table | None:
        reads.append(ds)
        return late_impressions(root, ds, minutes)

    monkeypatch.setattr(derived, "late_impressions", counted)
    write_day(tmp_path, events_table())
    assert run(tmp_path).success and reads == []

    # An engagement whose impression is not in the day: the day before's last impressions are looked up.
    table = events_table(impression_id=[1, 1, 1, 4, 4, 4, 7, 7, 7, 10, 10, 999])
    write_day(tmp_path, table)
    report = run(tmp_path)
    assert reads == [DS]
    assert failed(report) == ["engagement.has_impression"]


def _linked(table: pa.Table, late: pa.Table) -> list[bool]:
    """The engagement link, row by row: an impression itself, or the first impression of the day (else of the
    day before's last ones) with the referenced id, of the same user and pin."""
    rows = table.to_pylist()
    day = {}
    for r in rows:
        if r["action"] == "impression":
            day.setdefault(r["event_id"], r)
    before = {}
    for r in late.to_pylist():
        before.setdefault(r["event_id"], r)
    out = []
    for r in rows:
        if r["action"] == "impression":
            out.append(r["impression_id"] == r["event_id"])
            continue
        found = day.get(r["impression_id"]) or before.get(r["impression_id"])
        out.append(found is not None and found["user_id"] == r["user_id"] and found["pin_id"] == r["pin_id"])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_has_impression_in_any_row_order_and_with_the_day_before(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 60
    table = events_table(
        n,
        impression_id=[i - i % 3 + 1 if rng.random() < 0.8 else int(rng.integers(1, 80)) for i in range(n)],
        user_id=[int(u) for u in rng.integers(1, 3, n)],
        pin_id=[int(p) for p in rng.integers(100, 102, n)],
        ts=[START] * n,
    )
    late = pa.table({"event_id": [75, 70, 75], "user_id": [2, 1, 1], "pin_id": [101, 100, 101]})
    assert derived.has_impression(table, late).to_pylist() == _linked(table, late)
    shuffled = table.take(pa.array(rng.permutation(n)))
    assert derived.has_impression(shuffled, lambda: late).to_pylist() == _linked(shuffled, late)
    none = late.slice(0, 0)
    assert derived.has_impression(table, None).to_pylist() == _linked(table, none)
