"""History checks, thresholds and quarantine details of the validation gate (features/validation/history.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

from core import contracts, storage
from core.config import ValidationConfig
from features import validate
from features.validation import history
from features.validation.report import quarantine_records

pytestmark = pytest.mark.unit

MIX = {"impression": 0.83, "click": 0.09, "repin": 0.035, "hide": 0.025, "closeup": 0.02}


def profile(rows: int = 1000, mix: dict[str, float] | None = None, nulls: float = 0.0) -> dict:
    mix = mix or MIX
    return {
        "rows": rows,
        "action_counts": {a: round(share * rows) for a, share in mix.items()},
        "action_mix": dict(mix),
        "null_rates": {"user_id": nulls, "pin_id": 0.0},
    }


ROWS = (980, 1010, 1000, 990, 1020, 1000, 995)
HISTORY = [(f"2024-04-{d:02d}", profile(rows)) for d, rows in zip(range(24, 31), ROWS, strict=True)]
CONFIG = ValidationConfig()


def results(p: dict, hist: list = HISTORY, config: ValidationConfig = CONFIG) -> dict:
    return {r.name: r for r in history.history_checks("events", "2024-05-01", p, hist, config)}


def test_a_normal_day_passes_every_history_check() -> None:
    checks = results(profile(1005))
    assert [c.success for c in checks.values()] == [True, True, True]
    assert checks["history.volume"].observed["trailing_days_median"] == 1000
    assert checks["history.action_mix"].observed["psi"] < 0.001


@pytest.mark.parametrize(("rows", "ok"), [(499, False), (500, True), (2000, True), (2001, False)])
def test_volume_band_around_the_trailing_median(rows: int, ok: bool) -> None:
    check = results(profile(rows))["history.volume"]
    assert check.success is ok
    if not ok:
        assert "the median of the 7 trailing days (1000)" in check.details


def test_actions_outside_the_contract_are_left_to_action_in_set() -> None:
    """A fifth of the day's events with an unknown action: action.in_set fails it; the mix of the contract's actions
    is what it was, so the mix check passes (it failed too before, one problem said twice)."""
    with_unknown = {a: share * 0.8 for a, share in MIX.items()} | {"like": 0.2}
    check = results(profile(mix=with_unknown))["history.action_mix"]
    assert check.success is True and check.observed["psi"] < 0.001 and "like" not in check.observed["mix"]


def test_action_mix_shift_names_the_shifted_actions() -> None:
    shifted = {"impression": 0.70, "click": 0.25, "repin": 0.02, "hide": 0.02, "closeup": 0.01}
    check = results(profile(mix=shifted))["history.action_mix"]
    assert check.success is False and check.observed["psi"] > 0.1
    assert "click 9.0% -> 25.0%" in check.details


def test_null_rate_jump() -> None:
    check = results(profile(nulls=0.02))["history.null_rate"]
    assert check.success is False and check.observed == {"user_id": {"null_rate": 0.02, "trailing_median": 0.0}}
    assert results(profile(nulls=0.005))["history.null_rate"].success


def test_first_days_pass_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    checks = results(profile(10), hist=HISTORY[:2])
    assert all(c.success for c in checks.values())
    assert all(c.details.startswith("warning:") for c in checks.values())
    assert "min_history_days=3" in caplog.text


def test_psi() -> None:
    assert history.psi(MIX, MIX) == 0.0
    assert math.isclose(history.psi({"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75}), 0.25 * math.log(2) + 0.25 * math.log(1.5))
    assert history.psi({"a": 1.0}, {"a": 0.5, "b": 0.5}) > 1.0  # an empty bucket: large and finite


def test_thresholds_are_the_configured_ones() -> None:
    tight = ValidationConfig(volume_min_ratio=0.999, volume_max_ratio=1.001)
    checks = results(profile(1065), config=tight)
    assert checks["history.volume"].success is False
    assert "expected between 0.999x and 1.001x" in checks["history.volume"].details
    assert checks["history.volume"].expected == pytest.approx({"min_rows": 999.0, "max_rows": 1001.0})
    assert results(profile(1065))["history.volume"].success  # the default band [0.5, 2]
    checks = results(profile(1000), hist=HISTORY[:4], config=ValidationConfig(history_days=5, min_history_days=5))
    assert all(c.details.startswith("warning:") and c.success for c in checks.values())


def test_history_skips_days_that_failed(tmp_path: Path) -> None:
    for day, ok in (("2024-04-29", True), ("2024-04-30", False)):
        folder = Path(validate.report_dir(tmp_path, "events", day))
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({"success": ok}))
        (folder / history.PROFILE_FILE).write_text(json.dumps(profile()))
    assert [d for d, _ in history.trailing_profiles(tmp_path, "events", "2024-05-01", 7)] == ["2024-04-29"]


def test_history_reads_profiles_from_an_object_store() -> None:
    root = "memory://pinflow-test-history"
    try:
        for day in ("2024-04-28", "2024-04-30"):
            folder = validate.report_dir(root, "events", day)
            storage.write_json(storage.join(folder, "result.json"), {"success": True})
            storage.write_json(storage.join(folder, history.PROFILE_FILE), profile(rows=int(day[-2:])))
        found = history.trailing_profiles(root, "events", "2024-05-01", 7)
        assert [(d, p["rows"]) for d, p in found] == [("2024-04-28", 28), ("2024-04-30", 30)]
    finally:
        storage.remove_tree(root)


def test_cli_quarantines_a_failed_partition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = pa.table(
        {"user_id": [1, 2], "country": ["US", "usa"], "created_at": pa.array([0, 0], contracts.TS)},
        schema=contracts.USERS_SCHEMA,
    )
    part = Path(storage.write_table(tmp_path, "raw/users", "2024-05-01", table))

    code = validate.main(["users", "--root", str(tmp_path), "--ds", "2024-05-01", "--quarantine", "--no-data-docs"])

    out = capsys.readouterr().out.strip().splitlines()
    assert code == 2 and not part.exists()
    report = json.loads(Path(out[-1]).read_text())
    assert report["failed_checks"] == ["country.well_formed"] and report["quarantine"]
    assert any("Quarantined" in line for line in out)
    assert "Quarantined" in (Path(out[-1]).parent / "index.html").read_text()
    [record] = quarantine_records(tmp_path, "users", "2024-05-01")
    assert json.loads((Path(record) / "QUARANTINE.json").read_text())["failed_checks"] == ["country.well_formed"]
    assert (Path(record) / "data" / storage.MARKER).exists()

    # Validated again before a fixed partition landed: the report says where it went, not "has not landed".
    assert validate.main(["users", "--root", str(tmp_path), "--ds", "2024-05-01", "--no-data-docs"]) == 2
    again = json.loads(Path(capsys.readouterr().out.strip().splitlines()[-1]).read_text())
    assert f"it was quarantined ({record}: its data and report); land a fixed partition there" in json.dumps(again)


# --- real traffic: a weekly cycle, holidays ------------------------------------------------------------------
# Four weeks of a weekly cycle ending the day before 2024-05-01 (a Wednesday): weekends at 40% of weekdays.
TIGHT = ValidationConfig(volume_min_ratio=0.7, volume_max_ratio=1.4)


def weekly(day: str) -> dict:
    import datetime as dt

    weekend = dt.date.fromisoformat(day).weekday() >= 5
    return profile(400 if weekend else 1000)


def cycle_history(ds: str, weeks: int = 4) -> tuple[list, list]:
    from core import storage

    days = [(storage.shift_ds(ds, -back), weekly(storage.shift_ds(ds, -back))) for back in range(7, 0, -1)]
    weekdays = [(storage.shift_ds(ds, -7 * k), weekly(storage.shift_ds(ds, -7 * k))) for k in range(weeks, 0, -1)]
    return days, weekdays


def test_a_quiet_sunday_passes_against_last_sundays_and_a_halved_tuesday_fails() -> None:
    sunday = "2024-05-05"
    days, weekdays = cycle_history(sunday)
    trailing_only = ValidationConfig(volume_min_ratio=0.7, volume_max_ratio=1.4, history_baseline="days")
    sunday_checks = {r.name: r for r in history.history_checks("events", sunday, weekly(sunday), days, TIGHT, weekdays)}
    assert sunday_checks["history.volume"].success is True
    assert sunday_checks["history.volume"].observed["baseline"] == "same_weekday"
    # Against the trailing days alone (the old baseline) the same Sunday fails.
    alone = history.history_checks("events", sunday, weekly(sunday), days, trailing_only, weekdays)
    assert alone[0].success is False and "trailing days" in alone[0].details

    tuesday = "2024-05-07"
    days, weekdays = cycle_history(tuesday)
    broken = profile(500)  # half a normal Tuesday: wrong against every baseline
    volume = history.history_checks("events", tuesday, broken, days, TIGHT, weekdays)[0]
    assert volume.success is False and "same weekday" in volume.details and "trailing days" in volume.details
    broken_mix = profile(1000, mix={"impression": 0.99, "click": 0.0, "repin": 0.005, "hide": 0.005, "closeup": 0.0})
    mix = {r.name: r for r in history.history_checks("events", tuesday, broken_mix, days, TIGHT, weekdays)}
    assert mix["history.action_mix"].success is False  # a broken action still fails


def test_a_holiday_only_warns() -> None:
    config = ValidationConfig(holidays=["2024-12-25"])
    assert config.severity_of("events", "history.volume", "2024-12-25") == "warn"
    assert config.severity_of("events", "history.volume", "2024-12-26") == "fail"
    assert config.severity_of("events", "events.action.in_set", "2024-12-25") == "fail"  # not a history check
