from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core import contracts, storage
from features.synthetic import DATASETS, WorldConfig, generate_world, main

SMALL = WorldConfig(start="2026-11-01", days=3, users=200, pins=300, categories=6, seed=11)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("world")
    return root, generate_world(root, SMALL)


def _read(root: Path, dataset: str, ds: str) -> pa.Table:
    return storage.read_table(root, dataset, ds)


def _np(table: pa.Table, column: str) -> np.ndarray:
    return table.column(column).to_numpy()


def _impression_labels(events: pa.Table) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """The impressions of a day in event order, and a boolean array per engagement action."""
    impressions = events.filter(pc.equal(events["action"], "impression"))
    ids = _np(impressions, "impression_id")
    labels = {}
    for action in contracts.ENGAGEMENTS:
        engaged = _np(events.filter(pc.equal(events["action"], action)), "impression_id")
        labels[action] = np.isin(ids, engaged)
    return impressions, labels


@pytest.mark.unit
def test_same_seed_gives_identical_tables_and_other_seed_differs(tmp_path: Path) -> None:
    config = WorldConfig(start="2026-11-01", days=2, users=60, pins=80, categories=4, seed=3)
    first = generate_world(tmp_path / "a", config)
    second = generate_world(tmp_path / "b", config)
    assert first == second
    other = tmp_path / "c"
    generate_world(other, dataclasses.replace(config, seed=4))
    for dataset in DATASETS:
        for ds in first["days"]:
            a = _read(tmp_path / "a", dataset, ds)
            assert a.equals(_read(tmp_path / "b", dataset, ds)), (dataset, ds)
            assert not a.equals(_read(other, dataset, ds)), (dataset, ds)

    # Generating more days leaves the earlier days unchanged.
    longer = tmp_path / "longer"
    generate_world(longer, dataclasses.replace(config, days=3))
    for dataset in DATASETS:
        for ds in first["days"]:
            assert _read(longer, dataset, ds).equals(_read(tmp_path / "a", dataset, ds)), (dataset, ds)

    # Rerunning into the same root replaces the days with the same data, markers included.
    before = _read(tmp_path / "a", "raw/events", "2026-11-02")
    generate_world(tmp_path / "a", config)
    assert storage.complete_days(tmp_path / "a", "raw/events") == first["days"]
    assert _read(tmp_path / "a", "raw/events", "2026-11-02").equals(before)


@pytest.mark.unit
def test_every_partition_is_complete_and_has_the_contract_schema(world: tuple[Path, dict[str, Any]]) -> None:
    root, summary = world
    assert summary["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    for dataset, schema in DATASETS.items():
        assert storage.complete_days(root, dataset) == summary["days"]
        for ds in summary["days"]:
            table = _read(root, dataset, ds)
            assert table.schema.equals(schema), f"{dataset} ds={ds}: {table.schema} != {schema}"
            assert table.num_rows > 0
            assert storage.read_metadata(root, dataset, ds)["rows"] == table.num_rows
    users = _read(root, "raw/users", summary["days"][-1])
    assert users.num_rows == summary["users"] == SMALL.users
    assert _read(root, "raw/pins", summary["days"][0]).num_rows == SMALL.pins
    assert _read(root, "raw/pins", summary["days"][-1]).num_rows == summary["pins"]


@pytest.mark.unit
def test_events_are_consistent_with_their_impressions_and_day(world: tuple[Path, dict[str, Any]]) -> None:
    root, summary = world
    all_ids = []
    impressions_total = 0
    for ds in summary["days"]:
        events = _read(root, "raw/events", ds)
        ts = _np(events, "ts").astype("datetime64[us]").astype(np.int64)
        start = int(np.datetime64(ds, "us").astype(np.int64))
        assert ts.min() >= start and ts.max() < start + 86_400 * 10**6
        assert (np.diff(ts) >= 0).all(), "events are sorted by ts"
        event_id = _np(events, "event_id")
        all_ids.append(event_id)
        assert set(_np(events, "action")) <= set(contracts.ACTIONS)
        assert set(_np(events, "surface")) <= set(contracts.SURFACES)

        action = _np(events, "action")
        is_imp = action == "impression"
        impression_id = _np(events, "impression_id")
        assert (impression_id[is_imp] == event_id[is_imp]).all()
        impressions_total += int(is_imp.sum())
        row_of = {int(i): row for row, i in enumerate(event_id[is_imp])}
        imp_rows = np.flatnonzero(is_imp)
        parent = imp_rows[[row_of[int(i)] for i in impression_id[~is_imp]]]  # KeyError: dangling engagement
        for column in ("user_id", "pin_id", "surface"):
            values = _np(events, column)
            assert (values[~is_imp] == values[parent]).all(), column
        assert (ts[~is_imp] > ts[parent]).all(), "an engagement comes after its impression"

        _, labels = _impression_labels(events)
        assert not (labels["hide"] & (labels["click"] | labels["repin"])).any()
        assert not (labels["closeup"] & ~labels["click"]).any()
        assert labels["repin"][~labels["click"]].any(), "a repin can happen without a click"
        for label, flags in labels.items():
            n_rows = int((action == label).sum())
            assert n_rows == flags.sum(), f"at most one {label} per impression"

        # Only pins of that day's snapshot are shown, and only after they were created.
        pins = _read(root, "raw/pins", ds)
        created_us = _np(pins, "created_at").astype("datetime64[us]").astype(np.int64)
        created = dict(zip(_np(pins, "pin_id").tolist(), created_us.tolist(), strict=True))
        shown = _np(events, "pin_id")[is_imp].tolist()
        assert all(created[p] < t for p, t in zip(shown, ts[is_imp].tolist(), strict=True))
        assert set(_np(events, "user_id")) <= set(_np(_read(root, "raw/users", ds), "user_id"))

    ids = np.concatenate(all_ids)
    assert len(np.unique(ids)) == len(ids)
    assert impressions_total == summary["impressions"]
    assert sum(len(i) for i in all_ids) == summary["events"]


@pytest.mark.unit
def test_positive_rates_are_in_the_documented_ranges(world: tuple[Path, dict[str, Any]]) -> None:
    rates = world[1]["positive_rates"]
    assert 0.07 <= rates["click"] <= 0.14, rates
    assert 0.025 <= rates["repin"] <= 0.06, rates
    assert 0.02 <= rates["hide"] <= 0.045, rates
    assert 0.0 < rates["closeup"] < rates["click"], rates


@pytest.mark.unit
def test_truth_has_one_row_per_impression_and_matches_the_labels(world: tuple[Path, dict[str, Any]]) -> None:
    root, summary = world
    for ds in summary["days"]:
        impressions, labels = _impression_labels(_read(root, "raw/events", ds))
        truth = _read(root, "truth", ds)
        assert truth.num_rows == impressions.num_rows
        by_id = truth.sort_by("impression_id")
        order = np.argsort(_np(impressions, "impression_id"))
        assert (_np(by_id, "impression_id") == _np(impressions, "impression_id")[order]).all()
        for label in contracts.LABELS:
            p = _np(by_id, f"p_{label}")
            y = labels[label][order]
            assert ((p > 0) & (p < 1)).all()
            assert p[y].mean() > 1.5 * p[~y].mean(), label
            # Calibrated: the mean true probability is close to the observed rate.
            assert abs(p.mean() - y.mean()) < 0.25 * y.mean() + 0.005, label


def _recent_interest_lift(root: Path, days: list[str]) -> float:
    """Click rate of impressions in a category the user clicked or repinned the day before, over the others."""
    category: dict[int, int] = {}
    hit_clicks = hit_n = other_clicks = other_n = 0
    previous: set[tuple[int, int]] = set()
    for ds in days:
        pins = _read(root, "raw/pins", ds)
        category.update(zip(_np(pins, "pin_id").tolist(), _np(pins, "category").tolist(), strict=True))
        impressions, labels = _impression_labels(_read(root, "raw/events", ds))
        pin_category = [category[p] for p in _np(impressions, "pin_id").tolist()]
        keys = list(zip(_np(impressions, "user_id").tolist(), pin_category, strict=True))
        hit = np.array([k in previous for k in keys], dtype=bool)
        clicked = labels["click"]
        if ds != days[0]:
            hit_clicks += int(clicked[hit].sum())
            hit_n += int(hit.sum())
            other_clicks += int(clicked[~hit].sum())
            other_n += int((~hit).sum())
        engaged = clicked | labels["repin"]
        previous = {k for k, e in zip(keys, engaged.tolist(), strict=True) if e}
    assert hit_n > 200 and other_n > 200
    return (hit_clicks / hit_n) / (other_clicks / other_n)


@pytest.mark.unit
def test_recent_interest_raises_the_click_rate_of_recently_engaged_categories(tmp_path: Path) -> None:
    config = WorldConfig(start="2026-11-01", days=3, users=300, pins=300, categories=8, seed=5, active_rate=1.0)
    lift = _recent_interest_lift(tmp_path / "on", generate_world(tmp_path / "on", config)["days"])
    assert lift > 2.0, lift
    # Part of that lift is stable taste; without the hidden recent-interest term it is clearly smaller.
    off = dataclasses.replace(config, recent_weight=0.0)
    lift_off = _recent_interest_lift(tmp_path / "off", generate_world(tmp_path / "off", off)["days"])
    assert lift > 1.3 * lift_off, (lift, lift_off)


@pytest.mark.unit
def test_new_pins_join_the_snapshot_on_their_day(world: tuple[Path, dict[str, Any]]) -> None:
    root, summary = world
    snapshots = [_read(root, "raw/pins", ds) for ds in summary["days"]]
    assert [t.num_rows for t in snapshots] == [300, 303, 306] == [SMALL.pins, *[SMALL.pins + 3 * i for i in (1, 2)]]
    for ds, pins in zip(summary["days"], snapshots, strict=True):
        created = _np(pins, "created_at").astype("datetime64[us]")
        assert created.max() <= np.datetime64(ds, "us")
    # A snapshot extends the one before it: same pins, same attributes.
    assert snapshots[1].slice(0, SMALL.pins).equals(snapshots[0])
    assert snapshots[2].slice(0, 303).equals(snapshots[1])


@pytest.mark.unit
def test_invalid_config_names_the_setting() -> None:
    with pytest.raises(ValueError, match="users=0"):
        WorldConfig(start="2026-11-01", days=1, users=0)
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        WorldConfig(start="11/01/2026", days=1)


@pytest.mark.unit
def test_cli_prints_the_summary_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--root", str(tmp_path), "--start", "2026-11-01", "--days", "1", "--users", "20", "--pins", "30"]
    assert main([*argv, "--categories", "3", "--seed", "2", "--impressions-per-user", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["days"] == ["2026-11-01"] and summary["users"] == 20 and summary["pins"] == 30
    assert storage.is_complete(tmp_path, "truth", "2026-11-01")

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    flags = ("--root", "--start", "--days", "--users", "--pins", "--categories", "--seed", "--impressions-per-user")
    assert all(flag in usage for flag in flags)
