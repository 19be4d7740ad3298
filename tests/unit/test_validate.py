"""The raw-data validation gate: features/validate.py."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from features import contracts, storage, validate

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DS = "2024-05-01"
START = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
N = 12


def events_table(n: int = N, schema: pa.Schema = contracts.EVENTS, **overrides: list) -> pa.Table:
    """``n`` valid events of DS, the first and last microsecond of the day included: every third row is an
    impression, the two after it are engagements of the same user and pin that reference it."""
    ts = [START + dt.timedelta(hours=i) for i in range(n)]
    if n:
        ts[-1] = START + dt.timedelta(days=1, microseconds=-1)
    columns = {
        "event_id": [i + 1 for i in range(n)],
        "impression_id": [i - i % 3 + 1 for i in range(n)],
        "user_id": [1 + (i // 3) % 4 for i in range(n)],
        "pin_id": [100 + (i // 3) % 5 for i in range(n)],
        "action": ["impression" if i % 3 == 0 else contracts.ENGAGEMENTS[i % 4] for i in range(n)],
        "surface": [contracts.SURFACES[(i // 3) % len(contracts.SURFACES)] for i in range(n)],
        "ts": ts,
    }
    columns.update(overrides)
    return pa.table(columns, schema=schema)


def pins_table(n: int = N) -> pa.Table:
    return pa.table(
        {
            "pin_id": [100 + i for i in range(n)],
            "embedding": [[float(i)] * contracts.EMBEDDING_DIM for i in range(n)],
            "category": [i % 3 for i in range(n)],
            "creator_id": [1 + i % 2 for i in range(n)],
            "created_at": [START - dt.timedelta(days=i) for i in range(n)],
        },
        schema=contracts.PINS,
    )


def users_table(n: int = N) -> pa.Table:
    return pa.table(
        {
            "user_id": [1 + i for i in range(n)],
            "country": ["US" if i % 2 else "FR" for i in range(n)],
            "created_at": [START - dt.timedelta(days=i) for i in range(n)],
        },
        schema=contracts.USERS,
    )


def nullable(schema: pa.Schema) -> pa.Schema:
    """The contract with every field nullable, to write the nulls the contract forbids."""
    return pa.schema([f.with_nullable(True) for f in schema])


def write(root: Path, dataset: str, table: pa.Table) -> Path:
    return storage.write_table(root, f"raw/{dataset}", DS, table)


def statuses(report: validate.ValidationReport) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def failed(report: validate.ValidationReport) -> list[str]:
    return [c.name for c in report.failed_checks]


def check(report: validate.ValidationReport, name: str) -> validate.Check:
    return next(c for c in report.checks if c.name == name)


def write_day(root: Path) -> None:
    """A good day of all three datasets: the events reference the pins and users."""
    write(root, "events", events_table())
    write(root, "pins", pins_table())
    write(root, "users", users_table())


@pytest.fixture
def good_events(tmp_path: Path) -> Path:
    write_day(tmp_path)
    return tmp_path


# --- the good day -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("dataset", "make"), [("events", events_table), ("pins", pins_table), ("users", users_table)])
def test_good_partition_passes_every_check(tmp_path: Path, dataset: str, make) -> None:
    write_day(tmp_path)

    report = validate.validate_partition(tmp_path, dataset, DS, data_docs=dataset == "events")

    assert report.success, report.failure_message()
    assert set(statuses(report).values()) == {"passed"}
    assert [c.name for c in report.checks] == validate.check_names(dataset)
    assert report.rows == N
    assert report.report_path == tmp_path / "reports/validation" / dataset / f"ds={DS}" / "result.json"
    summary = report.summary()
    assert {k: summary[k] for k in ("dataset", "ds", "success", "rows", "failed_checks", "quarantine")} == {
        "dataset": dataset,
        "ds": DS,
        "success": True,
        "rows": N,
        "failed_checks": [],
        "quarantine": None,
    }
    assert summary["report_path"] == str(report.report_path)
    assert summary["warnings"] and "min_history_days" in summary["warnings"][0]  # the first day: no history
    assert (report.report_path.parent / "profile.json").exists()
    assert report.failure_message() == ""


def test_report_json_lists_every_check_with_observed_values(good_events: Path) -> None:
    report = validate.validate_partition(good_events, "raw/events", DS)

    payload = json.loads(report.report_path.read_text())
    assert payload["success"] is True
    assert payload["dataset"] == "events" and payload["ds"] == DS and payload["rows"] == N
    assert [c["name"] for c in payload["checks"]] == validate.check_names("events")
    for entry in payload["checks"]:
        assert entry["status"] == "passed" and entry["success"] is True
        assert {"observed", "expected", "details"} <= entry.keys()
    by_name = {c["name"]: c for c in payload["checks"]}
    assert by_name["table.row_count"]["observed"] == N
    assert by_name["ts.in_partition_day"]["expected"]["min_value"] == START.isoformat()
    assert by_name["action.in_set"]["expected"]["value_set"] == list(contracts.ACTIONS)
    out = report.report_path.parent
    assert "ts.in_partition_day" in (out / "index.html").read_text()
    assert (out / "data_docs" / "index.html").exists()  # the GX Data Docs site of the run
    assert not list(out.glob(".*"))  # no temporary leftovers


def test_check_names_match_the_suite() -> None:
    suite = validate.build_suite("events", DS)

    assert [(e.meta or {})["check"] for e in suite.expectations] == validate.suite_check_names("events")
    assert {
        "table.columns_match_set",
        "table.row_count",
        "event_id.not_null",
        "impression_id.not_null",
        "user_id.not_null",
        "pin_id.not_null",
        "event_id.unique",
        "action.in_set",
        "surface.in_set",
        "ts.in_partition_day",
    } <= set(validate.suite_check_names("events"))
    assert {"pin_id.unique", "category.not_null", "creator_id.not_null"} <= set(validate.suite_check_names("pins"))
    assert "user_id.unique" in validate.suite_check_names("users")


# --- each failure fails the check that names it -----------------------------------------------------


def test_missing_column(tmp_path: Path) -> None:
    write(tmp_path, "events", events_table().drop_columns(["surface"]))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["schema.columns", "table.columns_match_set"]
    assert check(report, "schema.columns").observed == {"missing": ["surface"], "unexpected": []}
    assert statuses(report)["surface.in_set"] == "skipped"
    assert statuses(report)["event_id.unique"] == "passed"  # the other columns are still checked


def test_wrong_type_of_a_column(tmp_path: Path) -> None:
    schema = contracts.EVENTS.set(
        contracts.EVENTS.get_field_index("user_id"), pa.field("user_id", pa.string(), nullable=False)
    )
    write(tmp_path, "events", events_table(schema=schema, user_id=[str(u) for u in events_table()["user_id"].to_pylist()]))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["schema.types"]
    types = check(report, "schema.types")
    assert types.observed == {"user_id": {storage.DATA_FILE: "string"}}
    assert types.expected == {"user_id": "int64"}
    assert "user_id" in types.details and "int64" in types.details
    assert statuses(report)["user_id.not_null"] == "skipped"


def test_null_user_id(tmp_path: Path) -> None:
    user_ids: list[int | None] = events_table()["user_id"].to_pylist()
    user_ids[4] = None  # an engagement
    write(tmp_path, "events", events_table(schema=nullable(contracts.EVENTS), user_id=user_ids))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["user_id.not_null"]
    assert check(report, "user_id.not_null").observed["unexpected_count"] == 1


def test_unknown_action(tmp_path: Path) -> None:
    actions = events_table()["action"].to_pylist()
    actions[5] = "like"  # an engagement
    write(tmp_path, "events", events_table(action=actions))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["action.in_set"]
    assert check(report, "action.in_set").observed["examples"] == ["like"]
    assert "like" in report.failure_message()


def test_ts_from_another_day(tmp_path: Path) -> None:
    ts = events_table()["ts"].to_pylist()
    ts[2] = START + dt.timedelta(days=1)  # the first microsecond of the next day is outside
    write(tmp_path, "events", events_table(ts=ts))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["ts.in_partition_day"]
    assert check(report, "ts.in_partition_day").observed["unexpected_count"] == 1


def test_duplicated_event_id(tmp_path: Path) -> None:
    ids = [i + 1 for i in range(N)]
    ids[8] = ids[7]  # two engagements share an id
    write(tmp_path, "events", events_table(event_id=ids))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["event_id.unique"]
    assert 8 in check(report, "event_id.unique").observed["examples"]


def test_duplicated_pin_id(tmp_path: Path) -> None:
    table = pins_table()
    write(tmp_path, "pins", table.set_column(0, "pin_id", pa.array([1] * N, pa.int64())))

    report = validate.validate_partition(tmp_path, "pins", DS, data_docs=False)

    assert failed(report) == ["pin_id.unique"]


def test_truncated_parquet_file(good_events: Path) -> None:
    data = storage.partition_path(good_events, "raw/events", DS) / storage.DATA_FILE
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    report = validate.validate_partition(good_events, "events", DS)

    assert failed(report) == ["files.readable"]
    assert str(data) in check(report, "files.readable").details
    assert str(data) in report.failure_message()
    assert report.rows is None
    assert {statuses(report)[n] for n in validate.suite_check_names("events")} == {"skipped"}
    assert [c["name"] for c in json.loads(report.report_path.read_text())["checks"]] == validate.check_names("events")


def test_missing_marker(good_events: Path) -> None:
    (storage.partition_path(good_events, "raw/events", DS) / storage.MARKER).unlink()

    report = validate.validate_partition(good_events, "events", DS, data_docs=False)

    assert failed(report) == ["partition.marker"]
    assert storage.MARKER in check(report, "partition.marker").details
    assert report.report_path.exists()


def test_missing_partition(tmp_path: Path) -> None:
    report = validate.validate_partition(tmp_path, "users", DS, data_docs=False)

    assert failed(report) == ["partition.marker"]
    assert "does not exist" in check(report, "partition.marker").details


def test_empty_partition_without_files(good_events: Path) -> None:
    (storage.partition_path(good_events, "raw/events", DS) / storage.DATA_FILE).unlink()

    report = validate.validate_partition(good_events, "events", DS, data_docs=False)

    assert failed(report) == ["partition.files"]


def test_empty_partition_without_rows(tmp_path: Path) -> None:
    write(tmp_path, "events", events_table(n=0))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    assert failed(report) == ["table.row_count"]
    assert check(report, "table.row_count").observed == 0


def test_failure_message_names_partition_checks_and_fix(tmp_path: Path) -> None:
    ids = [1] * N
    write(tmp_path, "events", events_table(event_id=ids, impression_id=ids, action=["like"] * N))

    report = validate.validate_partition(tmp_path, "events", DS, data_docs=False)

    message = report.failure_message()
    assert f"raw/events partition ds={DS}" in message
    assert "event_id.unique" in message and "action.in_set" in message
    assert f"{N} of {N} rows" in message
    assert str(report.report_path) in message
    assert "replace the partition" in message and "clear this task" in message
    assert report.summary()["failed_checks"] == ["event_id.unique", "action.in_set", "engagement.has_impression"]
    json.dumps(report.summary())


def test_rerun_replaces_the_report(good_events: Path) -> None:
    assert validate.validate_partition(good_events, "events", DS).success
    (storage.partition_path(good_events, "raw/events", DS) / storage.MARKER).unlink()

    report = validate.validate_partition(good_events, "events", DS)

    assert json.loads(report.report_path.read_text())["success"] is False
    assert not (report.report_path.parent / "data_docs").exists()  # no stale docs of the good run


def test_unknown_dataset_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown raw dataset 'clicks'"):
        validate.validate_partition(tmp_path, "clicks", DS)


# --- command line -----------------------------------------------------------------------------------


def test_cli_passes_with_exit_0_and_prints_the_report_path(good_events: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "features.validate", "events", "--root", str(good_events), "--ds", DS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    report_path = Path(proc.stdout.strip().splitlines()[-1])
    assert report_path == good_events / "reports/validation/events" / f"ds={DS}" / "result.json"
    assert json.loads(report_path.read_text())["success"] is True


def test_cli_fails_with_exit_2_and_prints_the_report_path(good_events: Path, capsys) -> None:
    (storage.partition_path(good_events, "raw/events", DS) / storage.MARKER).unlink()

    code = validate.main(["events", "--root", str(good_events), "--ds", DS])

    out = capsys.readouterr().out
    assert code == 2
    assert "partition.marker" in out
    report_path = Path(out.strip().splitlines()[-1])
    assert json.loads(report_path.read_text())["failed_checks"] == ["partition.marker"]


@pytest.mark.parametrize(
    "argv",
    [["events", "--root", "ROOT", "--ds", "2024-13-01"], ["clicks", "--root", "ROOT", "--ds", DS], ["events"]],
)
def test_cli_tool_errors_exit_1(tmp_path: Path, argv: list[str], capsys) -> None:
    argv = [str(tmp_path) if a == "ROOT" else a for a in argv]
    code: int | str | None
    try:
        code = validate.main(argv)
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    assert code == 1
    assert "error" in capsys.readouterr().err


def test_module_import_is_cheap() -> None:
    code = "import sys, features.validate; print(sorted({'great_expectations', 'pandas'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
