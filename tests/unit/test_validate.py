"""The raw-data validation gate: features/validate.py (the command) and features/validation/ (its stages)."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from core import config, contracts, storage
from core.config import ValidationConfig
from features import validate
from features.validation import history

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DS = "2024-05-01"
START = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
N = 12
CONFIG = ValidationConfig()


def events_table(n: int = N, schema: pa.Schema = contracts.EVENTS_SCHEMA, **overrides: list) -> pa.Table:
    """``n`` valid events of DS, the first and last microsecond of the day included: every third row is an
    impression, the two after it are engagements of the same user and pin that reference it."""
    ts = [START + dt.timedelta(minutes=i) for i in range(n)]
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
            "image_embedding": [[float(i) / n] * contracts.IMAGE_DIM for i in range(n)],
            "text_tokens": [[i % contracts.TEXT_VOCAB, 7] for i in range(n)],
        },
        schema=contracts.PINS_SCHEMA,
    )


def users_table(n: int = N) -> pa.Table:
    return pa.table(
        {
            "user_id": [1 + i for i in range(n)],
            "country": ["US" if i % 2 else "FR" for i in range(n)],
            "created_at": [START - dt.timedelta(days=i) for i in range(n)],
        },
        schema=contracts.USERS_SCHEMA,
    )


def nullable(schema: pa.Schema) -> pa.Schema:
    """The contract with every field nullable, to write the nulls the contract forbids."""
    return pa.schema([f.with_nullable(True) for f in schema])


def write(root: Path | str, dataset: str, table: pa.Table, ds: str = DS) -> str:
    return storage.write_table(root, f"raw/{dataset}", ds, table)


def validate_partition(root: Path | str, dataset: str, ds: str = DS, **kwargs) -> validate.ValidationReport:
    """``validate_partition`` with the default thresholds; Data Docs only where asked for (they take time)."""
    kwargs.setdefault("data_docs", False)
    return validate.validate_partition(root, dataset, ds, config=CONFIG, **kwargs)


def data_file(root: Path, dataset: str = "raw/events") -> Path:
    return Path(storage.partition(root, dataset, DS)) / storage.DATA_FILE


def marker(root: Path, dataset: str = "raw/events") -> Path:
    return Path(storage.partition(root, dataset, DS)) / storage.MARKER


def statuses(report: validate.ValidationReport) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def failed(report: validate.ValidationReport) -> list[str]:
    return [c.name for c in report.failed_checks]


def check(report: validate.ValidationReport, name: str) -> validate.Check:
    return next(c for c in report.checks if c.name == name)


def write_day(root: Path | str) -> None:
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

    report = validate_partition(tmp_path, dataset, data_docs=dataset == "events")

    assert report.success, report.failure_message()
    assert set(statuses(report).values()) == {"passed"}
    assert [c.name for c in report.checks] == validate.check_names(dataset)
    assert report.rows == N
    assert report.report_path == str(tmp_path / "reports/validation" / dataset / f"ds={DS}" / "result.json")
    summary = report.summary()
    assert {k: summary[k] for k in ("dataset", "ds", "success", "rows", "failed_checks", "quarantine")} == {
        "dataset": dataset,
        "ds": DS,
        "success": True,
        "rows": N,
        "failed_checks": [],
        "quarantine": None,
    }
    assert summary["report_path"] == report.report_path
    assert summary["warnings"] and "min_history_days" in summary["warnings"][0]  # the first day: no history
    assert (Path(report.folder) / "profile.json").exists()
    assert report.failure_message() == ""


def test_report_json_lists_every_check_with_observed_values(good_events: Path) -> None:
    report = validate_partition(good_events, "raw/events", data_docs=True)

    payload = json.loads(Path(report.report_path).read_text())
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
    out = Path(report.folder)
    assert "ts.in_partition_day" in (out / "index.html").read_text()
    assert (out / "data_docs" / "index.html").exists()  # the GX Data Docs site of the run
    assert not list(out.glob(".*")) and not list(out.parent.glob(".*"))  # no temporary leftovers


def test_check_names_match_the_suite() -> None:
    suite = validate.build_suite("events", DS, config=CONFIG)

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

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["schema.columns", "table.columns_match_set"]
    assert check(report, "schema.columns").observed == {"missing": ["surface"], "unexpected": []}
    columns = check(report, "table.columns_match_set")  # names the file's columns, not the derived check columns
    assert "surface" in columns.details and "_check_" not in columns.details + json.dumps(columns.observed)
    assert statuses(report)["surface.in_set"] == "skipped"
    assert statuses(report)["event_id.unique"] == "passed"  # the other columns are still checked


def test_wrong_type_of_a_column(tmp_path: Path) -> None:
    schema = contracts.EVENTS_SCHEMA.set(
        contracts.EVENTS_SCHEMA.get_field_index("user_id"), pa.field("user_id", pa.string(), nullable=False)
    )
    write(tmp_path, "events", events_table(schema=schema, user_id=[str(u) for u in events_table()["user_id"].to_pylist()]))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["schema.types"]
    types = check(report, "schema.types")
    assert types.observed == {"user_id": {storage.DATA_FILE: "string"}}
    assert types.expected == {"user_id": "int64"}
    assert "user_id" in types.details and "int64" in types.details
    assert statuses(report)["user_id.not_null"] == "skipped"


def test_null_user_id(tmp_path: Path) -> None:
    user_ids: list[int | None] = events_table()["user_id"].to_pylist()
    user_ids[4] = None  # an engagement
    write(tmp_path, "events", events_table(schema=nullable(contracts.EVENTS_SCHEMA), user_id=user_ids))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["user_id.not_null"]
    assert check(report, "user_id.not_null").observed["unexpected_count"] == 1
    # The report is strict JSON (no bare NaN for the missing id) and shows no "e.g. NaN".
    text = Path(report.report_path).read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"result.json holds {name}"))
    assert "NaN" not in check(report, "user_id.not_null").details
    # The null's own value names nothing: the report names the rows' event ids.
    assert check(report, "user_id.not_null").details.endswith("; offending event_id: [5]")
    assert check(report, "user_id.not_null").observed["offending_event_id"] == [5]


def test_null_event_id_names_its_row(tmp_path: Path) -> None:
    event_ids: list[int | None] = events_table()["event_id"].to_pylist()
    event_ids[2] = event_ids[7] = None
    write(tmp_path, "events", events_table(schema=nullable(contracts.EVENTS_SCHEMA), event_id=event_ids))

    report = validate_partition(tmp_path, "events")

    assert "event_id.not_null" in failed(report)
    assert "; offending rows (numbered from 0, files in name order): [2, 7]" in check(report, "event_id.not_null").details
    assert check(report, "event_id.not_null").observed["offending_rows"] == [2, 7]


def test_unknown_action(tmp_path: Path) -> None:
    actions = events_table()["action"].to_pylist()
    actions[5] = "like"  # an engagement
    write(tmp_path, "events", events_table(action=actions))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["action.in_set"]
    assert check(report, "action.in_set").observed["examples"] == ["like"]
    assert "like" in report.failure_message()


def test_ts_from_another_day(tmp_path: Path) -> None:
    ts = events_table()["ts"].to_pylist()
    ts[2] = START + dt.timedelta(days=1)  # the first microsecond of the next day is outside
    write(tmp_path, "events", events_table(ts=ts))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["ts.in_partition_day"]
    assert check(report, "ts.in_partition_day").observed["unexpected_count"] == 1


def test_duplicated_event_id(tmp_path: Path) -> None:
    ids = [i + 1 for i in range(N)]
    ids[8] = ids[7]  # two engagements share an id
    write(tmp_path, "events", events_table(event_id=ids))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["event_id.unique"]
    assert 8 in check(report, "event_id.unique").observed["examples"]


def test_duplicated_pin_id(tmp_path: Path) -> None:
    table = pins_table()
    write(tmp_path, "pins", table.set_column(0, "pin_id", pa.array([1] * N, pa.int64())))

    report = validate_partition(tmp_path, "pins")

    assert failed(report) == ["pin_id.unique"]


def test_truncated_parquet_file(good_events: Path) -> None:
    data = data_file(good_events)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    report = validate_partition(good_events, "events", data_docs=True)

    assert failed(report) == ["files.readable"]
    assert str(data) in check(report, "files.readable").details
    assert str(data) in report.failure_message()
    assert report.rows is None
    assert {statuses(report)[n] for n in validate.suite_check_names("events")} == {"skipped"}
    assert [c["name"] for c in json.loads(Path(report.report_path).read_text())["checks"]] == validate.check_names("events")


def test_missing_marker(good_events: Path) -> None:
    marker(good_events).unlink()

    report = validate_partition(good_events, "events")

    assert failed(report) == ["partition.marker"]
    assert storage.MARKER in check(report, "partition.marker").details
    assert Path(report.report_path).exists()


def test_missing_partition(tmp_path: Path) -> None:
    report = validate_partition(tmp_path, "users")

    assert failed(report) == ["partition.marker"]
    assert "does not exist" in check(report, "partition.marker").details


def test_empty_partition_without_files(good_events: Path) -> None:
    data_file(good_events).unlink()

    report = validate_partition(good_events, "events")

    assert failed(report) == ["partition.files"]


def test_empty_partition_without_rows(tmp_path: Path) -> None:
    write(tmp_path, "events", events_table(n=0))

    report = validate_partition(tmp_path, "events")

    assert failed(report) == ["table.row_count"]
    assert check(report, "table.row_count").observed == 0


def test_failure_message_names_partition_checks_and_fix(tmp_path: Path) -> None:
    ids = [1] * N
    write(tmp_path, "events", events_table(event_id=ids, impression_id=ids, action=["like"] * N))

    report = validate_partition(tmp_path, "events")

    message = report.failure_message()
    assert f"raw/events partition ds={DS}" in message
    assert "event_id.unique" in message and "action.in_set" in message
    assert f"{N} of {N} rows" in message
    assert report.report_path in message
    assert "replace the partition" in message and "clear this task" in message
    assert report.summary()["failed_checks"] == ["event_id.unique", "action.in_set", "engagement.has_impression"]
    json.dumps(report.summary())


def test_rerun_replaces_the_report(good_events: Path) -> None:
    assert validate_partition(good_events, "events", data_docs=True).success
    marker(good_events).unlink()

    report = validate_partition(good_events, "events", data_docs=True)

    assert json.loads(Path(report.report_path).read_text())["success"] is False
    assert not (Path(report.folder) / "data_docs").exists()  # no stale docs of the good run
    assert not (Path(report.folder) / "profile.json").exists()  # nor its profile


def test_unknown_dataset_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown raw dataset 'clicks'"):
        validate_partition(tmp_path, "clicks")


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
    marker(good_events).unlink()

    code = validate.main(["events", "--root", str(good_events), "--ds", DS])

    out = capsys.readouterr().out
    assert code == 2
    assert "partition.marker" in out
    # A command's user has no task to clear: the fix says to run the command again.
    assert "then run this command again to validate it again." in out and "clear this task" not in out
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


def test_cli_on_a_full_disk_exits_75_naming_it_and_writes_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk is the world, not a bug: exit 75 (INFRA: the DAG's retries and a rerun succeed once space is
    freed), one line naming it, no traceback; the partition stays as it was and no report half-appears."""
    import errno

    from features.validation import report as report_module

    write_day(tmp_path)
    before = sorted(p.name for p in Path(storage.partition(tmp_path, "raw/events", DS)).iterdir())
    write_json = storage.write_json

    def full_disk(location: str, payload: object) -> None:
        if location.endswith("result.json"):
            raise OSError(errno.ENOSPC, "No space left on device", location)
        write_json(location, payload)

    monkeypatch.setattr(report_module.storage, "write_json", full_disk)

    code = validate.main(["events", "--root", str(tmp_path), "--ds", DS, "--no-data-docs"])

    err = capsys.readouterr().err
    assert code == validate.EXIT_RETRY == 75, err
    assert "No space left on device" in err and f"free space under {tmp_path}" in err and "Traceback" not in err
    assert sorted(p.name for p in Path(storage.partition(tmp_path, "raw/events", DS)).iterdir()) == before
    reports = Path(validate.report_dir(tmp_path, "events", DS)).parent
    assert not reports.exists() or [p.name for p in reports.iterdir()] == [], "no report and no staging folder left"


def test_module_import_is_cheap() -> None:
    code = "import sys, features.validate; print(sorted({'great_expectations', 'pandas'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_cli_takes_its_thresholds_from_the_platform_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A day at 1.065x the trailing median passes the default volume band and fails a tighter configured one,
    as the DAG's validation task would judge it."""
    write_day(tmp_path)
    write(tmp_path, "events", events_table(n=213))
    trailing = history.profile_table("events", events_table(n=200))
    for back in (1, 2, 3):
        folder = Path(validate.report_dir(tmp_path, "events", storage.shift_ds(DS, -back)))
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({"success": True}))
        (folder / "profile.json").write_text(json.dumps(trailing))
    argv = ["events", "--root", str(tmp_path), "--ds", DS, "--no-data-docs"]
    config.load.cache_clear()
    try:
        assert validate.main(argv) == 0, capsys.readouterr().out
        monkeypatch.setenv("PINFLOW_VALIDATION__VOLUME_MIN_RATIO", "0.999")
        monkeypatch.setenv("PINFLOW_VALIDATION__VOLUME_MAX_RATIO", "1.001")
        config.load.cache_clear()

        code = validate.main(argv)

        out = capsys.readouterr().out
        assert code == 2, out
        assert "history.volume: 213 rows is 1.06x the median of the 3 trailing days (200)" in out
        assert "expected between 0.999x and 1.001x" in out
        monkeypatch.setenv("PINFLOW_VALIDATION__VOLUME_MAX_RATIO", "0.9")  # not a valid band: a tool error
        config.load.cache_clear()
        assert validate.main(argv) == 1
        assert "validation.volume_max_ratio" in capsys.readouterr().err
    finally:
        config.load.cache_clear()


# --- an object-store root (fsspec's in-process memory filesystem: the code path of s3://) ---------------


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://pinflow-test-{uuid.uuid4().hex[:8]}"
    yield root
    storage.remove_tree(root)


def test_validation_on_an_object_store_passes_and_writes_the_report_there(memory_root: str) -> None:
    write_day(memory_root)

    report = validate_partition(memory_root, "events", data_docs=True)

    assert report.success, report.failure_message()
    assert report.report_path == storage.join(validate.report_dir(memory_root, "events", DS), "result.json")
    assert report.report_path.startswith("memory://")
    assert storage.read_json(report.report_path)["success"] is True
    assert set(storage.list_names(report.folder)) == {"result.json", "index.html", "profile.json", "data_docs"}
    assert report.data_docs_path == storage.join(report.folder, "data_docs", "index.html")
    assert "<html" in storage.read_text(report.data_docs_path).lower()  # GX's site, copied from a local folder


def test_validation_on_an_object_store_fails_and_quarantines(memory_root: str) -> None:
    write_day(memory_root)
    assert validate_partition(memory_root, "events").success  # a first run's report, replaced below
    actions = events_table()["action"].to_pylist()
    actions[5] = "like"
    part = write(memory_root, "events", events_table(action=actions))

    report = validate_partition(memory_root, "events", quarantine=True)

    assert failed(report) == ["action.in_set"]
    assert not storage.is_complete(memory_root, "raw/events", DS) and not storage.is_dir(part)
    record = report.quarantine
    assert record is not None and record.startswith(storage.join(memory_root, "quarantine", "events", f"ds={DS}"))
    assert storage.list_names(storage.join(record, "data")) == [storage.MARKER, storage.DATA_FILE]
    assert storage.read_json(storage.join(record, "report", "result.json"))["failed_checks"] == ["action.in_set"]
    assert storage.read_json(storage.join(record, "QUARANTINE.json"))["source"] == part
    result = storage.read_json(report.report_path)
    assert result["success"] is False and result["quarantine"] == record
    assert storage.is_complete(memory_root, "raw/pins", DS)  # the other partitions stay


def test_quarantine_removes_the_marker_before_moving_anything(memory_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an object store a move is a copy then a delete: readers must stop seeing the partition first."""
    from features.validation import report as report_module

    part = write(memory_root, "users", users_table())
    seen: list[bool] = []
    move_tree = storage.move_tree

    def watched_move(source: str, target: str) -> None:
        seen.append(storage.is_complete(memory_root, "raw/users", DS))
        move_tree(source, target)

    monkeypatch.setattr(report_module.storage, "move_tree", watched_move)

    record = report_module.quarantine_partition(memory_root, "users", DS)

    assert seen == [False]
    assert storage.exists(storage.join(record, "data", storage.MARKER)) and not storage.is_dir(part)


def test_a_quarantine_that_cannot_move_leaves_the_partition_and_a_failed_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed verdict is written before the partition moves: a full disk (or a kill) then never leaves a stale
    passed report beside a half-made quarantine record. Two validations at once: one moves it, the other names its
    record."""
    import errno

    from features.validation import partition as partition_module
    from features.validation import report as report_module

    root = str(tmp_path)
    write_day(root)
    assert validate_partition(root, "events").success
    actions = events_table()["action"].to_pylist()
    actions[5] = "like"
    write(root, "events", events_table(action=actions))

    def disk_full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(partition_module, "quarantine_partition", disk_full)
    with pytest.raises(OSError, match="No space left"):
        validate_partition(root, "events", quarantine=True)
    assert storage.is_complete(root, "raw/events", DS)  # still where it landed, marker and all
    result = storage.join(report_module.report_dir(root, "events", DS), report_module.RESULT_FILE)
    assert storage.read_json(result)["failed_checks"] == ["action.in_set"]
    monkeypatch.undo()

    moved_meanwhile = report_module.quarantine_partition(root, "events", DS)  # the other validation, first
    assert report_module.quarantine_partition(root, "events", DS) is None  # nothing left to move: no record made
    assert report_module.quarantine_records(root, "events", DS) == [moved_meanwhile]


def test_cli_accepts_a_url_root(memory_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    write_day(memory_root)

    code = validate.main(["users", "--root", memory_root, "--ds", DS, "--no-data-docs"])

    assert code == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == storage.join(
        validate.report_dir(memory_root, "users", DS), "result.json"
    )


# --- real logs: engagements across midnight, severities, per-dataset thresholds --------------------------


def test_an_engagement_just_after_midnight_links_to_the_impression_before_it(tmp_path: Path) -> None:
    previous = storage.shift_ds(DS, -1)
    late = START - dt.timedelta(seconds=1)  # 23:59:59 the day before
    write(tmp_path, "events", events_table(3, event_id=[901, 902, 903], impression_id=[901, 902, 903],
                                           user_id=[1, 2, 3], pin_id=[100, 101, 102], action=["impression"] * 3,
                                           ts=[late - dt.timedelta(hours=3), late - dt.timedelta(minutes=5), late]),
          ds=previous)
    base = events_table()
    click_at = START + dt.timedelta(seconds=2)
    table = pa.concat_tables([base, events_table(
        2, event_id=[1001, 1002], impression_id=[903, 901], user_id=[3, 1], pin_id=[102, 100],
        action=["click", "click"], surface=["home_feed"] * 2, ts=[click_at, click_at])])
    write(tmp_path, "events", table)
    write(tmp_path, "pins", pins_table())
    write(tmp_path, "users", users_table())
    report = validate_partition(tmp_path, "events")
    has = check(report, "engagement.has_impression")
    # 903 was impressed a second before midnight: linked. 901 three hours before: outside the look-back.
    assert has.success is False and "offending event_id: [1002]" in has.details
    lenient = ValidationConfig(engagement_lookback_minutes=240)
    report = validate.validate_partition(tmp_path, "events", DS, config=lenient, data_docs=False)
    assert check(report, "engagement.has_impression").success is True


@pytest.mark.parametrize("in_time_order", [True, False])
def test_late_impressions_read_only_what_they_need_and_find_the_same_rows(tmp_path: Path, in_time_order: bool) -> None:
    """The day before's last impressions come from a read that skips row groups ending before the look-back (when
    the log is in time order) and decodes the action as dictionary codes: the same rows as filtering it all."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from features.validation.derived import late_impressions

    previous = storage.shift_ds(DS, -1)
    n = 3000
    table = events_table(n, ts=[START - dt.timedelta(days=1) + dt.timedelta(seconds=28.8 * i) for i in range(n)])
    if not in_time_order:
        table = table.take(pa.array([(i * 7919) % n for i in range(n)]))
    with storage.write_partition(tmp_path, "raw/events", previous) as staging:
        pq.write_table(table, Path(staging) / storage.DATA_FILE, row_group_size=250)
    start = START - dt.timedelta(minutes=60)
    naive = table.filter(pc.and_(pc.equal(table["action"], "impression"), pc.greater_equal(table["ts"], pa.scalar(start))))
    found = late_impressions(tmp_path, DS, 60.0)
    assert found is not None and found.num_rows == naive.num_rows > 0
    assert found.to_pylist() == naive.select(["event_id", "user_id", "pin_id"]).to_pylist()


def test_a_warn_level_check_is_reported_and_does_not_quarantine(tmp_path: Path) -> None:
    write(tmp_path, "events", events_table(action=["impression", "like", "click"] * (N // 3)))
    write(tmp_path, "pins", pins_table())
    write(tmp_path, "users", users_table())
    warn = ValidationConfig(severity={"events": {"action.in_set": "warn"}})
    report = validate.validate_partition(tmp_path, "events", DS, config=warn, data_docs=False, quarantine=True)
    assert report.success and report.quarantine is None and marker(tmp_path).exists()
    assert [c.name for c in report.warned_checks] == ["action.in_set"]
    assert any("action.in_set failed, reported only" in w for w in report.warnings)
    saved = json.loads(Path(report.report_path).read_text())
    assert saved["thresholds"]["severity"] == {"events": {"action.in_set": "warn"}}  # the report records them
    assert next(c for c in saved["checks"] if c["name"] == "action.in_set")["severity"] == "warn"
    # The same data at the default severity fails and is quarantined.
    report = validate_partition(tmp_path, "events", quarantine=True)
    assert not report.success and report.quarantine and not marker(tmp_path).exists()
    # A typo in a dataset or check name would change nothing: refused, naming it.
    from core.failures import ConfigError

    for typo, says in (({"severity": {"evnts": {"action.in_set": "warn"}}}, "severity.evnts: no such dataset (did you mean 'events'?)"),
                       ({"severity": {"events": {"action.inset": "warn"}}}, "'action.inset' names no check (did you mean 'action.in_set'?)"),
                       ({"per_dataset": {"evnts": {"volume_min_ratio": 1.0}}}, "per_dataset.evnts: no such dataset")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            validate.validate_partition(tmp_path, "events", DS, config=ValidationConfig(**typo), data_docs=False)


def test_thresholds_per_dataset_and_unknown_keys() -> None:
    config = ValidationConfig(per_dataset={"pin_labels": {"volume_min_ratio": 0.2}})
    assert config.for_dataset("pin_labels").volume_min_ratio == 0.2 and config.for_dataset("events").volume_min_ratio == 0.5
    with pytest.raises(ValueError, match="per_dataset.events: volum_min_ratio"):
        ValidationConfig(per_dataset={"events": {"volum_min_ratio": 0.2}})


# --- the bucketed copy for sharded builds (features.shards > 1) ------------------------------------------------


def test_a_passed_events_partition_is_bucketed_for_the_shards_and_a_failed_one_is_not(tmp_path: Path) -> None:
    from features import sharding

    write_day(tmp_path)
    report = validate_partition(tmp_path, "events", event_buckets=4)
    assert report.success, report.failure_message()
    by_user = read_table_all(tmp_path, contracts.EVENTS_BY_USER)
    assert sorted(by_user.column("impression_id").to_pylist()) == sorted(events_table().column("impression_id").to_pylist())
    meta = storage.read_metadata(tmp_path, contracts.EVENTS_BY_USER, DS)
    assert meta["hash_buckets"]["count"] == 4 and meta["source"] == f"raw/events/ds={DS}"
    # Each shard of 2 reads 2 of the 4 files (its buckets).
    assert len(sharding.shard_files(tmp_path, contracts.EVENTS_BY_USER, DS, sharding.Shard(0, 2, str(tmp_path / "staging")))) == 2
    # Not for the other datasets, nor when switched off, nor for a failed partition.
    assert storage.is_complete(tmp_path, contracts.EVENTS_BY_PIN, DS)
    validate_partition(tmp_path, "pins", event_buckets=4)
    assert not (tmp_path / "buckets" / "pins").exists()
    other = tmp_path / "other"
    write(other, "events", events_table(action=["bogus"] * N))
    assert not validate_partition(other, "events", event_buckets=4).success
    assert not storage.is_complete(other, contracts.EVENTS_BY_USER, DS)


def read_table_all(root: Path, dataset: str) -> pa.Table:
    return storage.read_table(root, dataset, DS)
