"""The Airflow side of the validation gate: trigger, deferrable sensor, operators, extra link, plugin."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from core import config, storage
from core.failures import DataError, UserError
from operators.sensors import RawPartitionSensor, RawPartitionTrigger, missing_partitions
from operators.validation import DataDocsLink, ValidatePartitionOperator, WindowGapCheckOperator

pytestmark = pytest.mark.unit

DS = "2024-05-01"


class FakeTI:
    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        json.dumps(value)  # XCom values must be JSON-serializable
        self.xcom[key] = value


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private storage root that the operators read through core.config."""
    monkeypatch.setenv("PINFLOW_STORAGE_ROOT", str(tmp_path))
    config.load.cache_clear()
    yield tmp_path
    config.load.cache_clear()


@pytest.fixture
def memory_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private object-store root (fsspec's in-process memory filesystem: the code path of s3://)."""
    location = f"memory://pinflow-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PINFLOW_STORAGE_ROOT", location)
    config.load.cache_clear()
    yield location
    config.load.cache_clear()
    storage.remove_tree(location)


def context(ti: FakeTI) -> Any:
    """The part of an Airflow task context the operators use."""
    return {"ti": ti}


def land(root: Path | str, dataset: str, ds: str = DS, marker: bool = True) -> str:
    """Land a partition as an upstream writer does: its data file ("PAR1" is no Parquet file), then its marker."""
    part = storage.partition(root, dataset, ds)
    storage.write_bytes(storage.join(part, storage.DATA_FILE), b"PAR1")
    if marker:
        storage.write_text(storage.join(part, storage.MARKER), "")
    return part


# --- trigger -----------------------------------------------------------------------------------------------


def test_trigger_serialize_round_trip() -> None:
    trigger = RawPartitionTrigger("/data", ["raw/events", "raw/pins"], DS, 15.0, "2024-05-02T06:00:00+00:00")

    classpath, kwargs = trigger.serialize()

    module, name = classpath.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert cls is RawPartitionTrigger
    assert kwargs == {
        "root": "/data",
        "datasets": ["raw/events", "raw/pins"],
        "ds": DS,
        "poke_interval": 15.0,
        "timeout_at": "2024-05-02T06:00:00+00:00",
    }
    json.dumps(kwargs)  # only plain arguments: nothing that cannot cross to the triggerer
    assert cls(**kwargs).serialize() == (classpath, kwargs)


def _first_event(trigger: RawPartitionTrigger) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout=10))


def test_trigger_fires_when_every_partition_landed(tmp_path: Path) -> None:
    land(tmp_path, "raw/events")
    land(tmp_path, "raw/pins")

    event = _first_event(RawPartitionTrigger(str(tmp_path), ["raw/events", "raw/pins"], DS, 0.01))

    assert event == {"status": "success", "ds": DS, "missing": {}}


def test_trigger_times_out_naming_what_is_missing(tmp_path: Path) -> None:
    land(tmp_path, "raw/events", marker=False)
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat()

    event = _first_event(RawPartitionTrigger(str(tmp_path), ["raw/events", "raw/pins"], DS, 0.01, past))

    assert event["status"] == "timeout"
    assert "no _SUCCESS marker" in event["missing"]["raw/events"] and "1 Parquet file" in event["missing"]["raw/events"]
    assert "does not exist" in event["missing"]["raw/pins"]


def test_trigger_keeps_waiting_until_the_marker_lands(tmp_path: Path) -> None:
    part = land(tmp_path, "raw/users", marker=False)
    trigger = RawPartitionTrigger(str(tmp_path), ["raw/users"], DS, 0.01)

    async def land_later_then_wait() -> dict[str, Any]:
        async def marker() -> None:
            await asyncio.sleep(0.05)
            storage.write_text(storage.join(part, storage.MARKER), "")

        task = asyncio.create_task(marker())
        async for event in trigger.run():
            await task
            return event.payload
        raise AssertionError("no event")

    assert asyncio.run(asyncio.wait_for(land_later_then_wait(), timeout=10))["status"] == "success"


# --- sensor ------------------------------------------------------------------------------------------------


def _sensor() -> RawPartitionSensor:
    return RawPartitionSensor(
        task_id="wait_for_raw", datasets=["raw/events", "raw/pins"], ds=DS, deferrable=True,
        poke_interval=5, timeout=600,
    )


def test_deferrable_sensor_returns_at_once_when_landed(root: Path) -> None:
    land(root, "raw/events")
    land(root, "raw/pins")

    assert _sensor().execute({}) is None  # type: ignore[arg-type]


def test_deferrable_sensor_defers_to_its_trigger(root: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    land(root, "raw/events")
    with pytest.raises(TaskDeferred) as deferred:
        _sensor().execute({})  # type: ignore[arg-type]

    trigger = deferred.value.trigger
    assert isinstance(trigger, RawPartitionTrigger)
    assert trigger.datasets == ["raw/events", "raw/pins"] and trigger.root == str(root) and trigger.ds == DS
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout is not None and deferred.value.timeout > dt.timedelta(seconds=600)
    deadline = dt.datetime.fromisoformat(trigger.timeout_at or "")
    assert dt.timedelta(seconds=590) < deadline - dt.datetime.now(dt.UTC) <= dt.timedelta(seconds=600)


def test_a_manual_rebuild_of_another_day_says_what_it_waits_for_and_how_to_run_at_once(root: Path, monkeypatch) -> None:
    """A rebuild of a past day from the form sat with "No Status" behind the run before its logical date."""
    from types import SimpleNamespace

    land(root, "raw/events")
    land(root, "raw/pins")
    sensor = _sensor()
    warnings: list[str] = []
    said_as = SimpleNamespace(warning=lambda message, *args: warnings.append(message % args), info=lambda *a: None)
    monkeypatch.setattr(RawPartitionSensor, "log", property(lambda self: said_as))
    for run_type, logical, warned in (("manual", dt.datetime(2026, 12, 5, 7, tzinfo=dt.UTC), True),
                                      ("manual", dt.datetime.fromisoformat(f"{DS}T00:00:00+00:00"), False),
                                      ("scheduled", dt.datetime(2026, 12, 5, tzinfo=dt.UTC), False)):
        warnings.clear()
        sensor.execute({"dag_run": SimpleNamespace(run_type=run_type), "logical_date": logical})  # type: ignore[arg-type]
        said = " ".join(warnings)
        assert ("wait until the DAG's run before 2026-12-05" in said) == warned, (run_type, logical, said)
        if warned:
            assert f"builds ds={DS} but is dated 2026-12-05" in said and f"Logical date set to {DS}T00:00:00Z" in said


def test_sensor_timeout_is_a_data_failure_naming_the_partitions() -> None:
    sensor = _sensor()
    sensor.execute_complete({}, {"status": "success"})  # type: ignore[arg-type]
    missing = {"raw/pins": "/data/raw/pins/ds=2024-05-01 does not exist"}

    with pytest.raises(DataError) as err:
        sensor.execute_complete({}, {"status": "timeout", "missing": missing})  # type: ignore[arg-type]

    assert "raw/pins" in str(err.value) and "does not exist" in str(err.value) and "600 s" in str(err.value)


def test_missing_partitions_names_folder_or_marker(tmp_path: Path) -> None:
    land(tmp_path, "raw/events", marker=False)
    land(tmp_path, "raw/users")

    missing = missing_partitions(str(tmp_path), ["raw/events", "raw/pins", "raw/users"], DS)

    assert set(missing) == {"raw/events", "raw/pins"}


def test_missing_partitions_on_an_object_store(memory_root: str) -> None:
    land(memory_root, "raw/events", marker=False)
    land(memory_root, "raw/users")

    missing = missing_partitions(memory_root, ["raw/events", "raw/pins", "raw/users"], DS)

    assert set(missing) == {"raw/events", "raw/pins"}
    assert missing["raw/events"] == (
        f"no _SUCCESS marker in {storage.partition(memory_root, 'raw/events', DS)} (1 Parquet file(s) so far)"
    )
    assert missing["raw/pins"] == f"{storage.partition(memory_root, 'raw/pins', DS)} does not exist"


def test_deferrable_sensor_on_an_object_store(memory_root: str) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    land(memory_root, "raw/events")
    with pytest.raises(TaskDeferred) as deferred:
        _sensor().execute({})  # type: ignore[arg-type]
    assert deferred.value.trigger.root == memory_root  # type: ignore[attr-defined]

    land(memory_root, "raw/pins")
    assert _first_event(deferred.value.trigger)["status"] == "success"  # type: ignore[arg-type]
    assert _sensor().execute({}) is None  # type: ignore[arg-type]


def test_sensor_timings_default_to_the_platform_config(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINFLOW_VALIDATION__SENSOR_POKE_SECONDS", "7")
    monkeypatch.setenv("PINFLOW_VALIDATION__SENSOR_TIMEOUT_SECONDS", "90")
    config.load.cache_clear()

    sensor = RawPartitionSensor(task_id="wait_for_raw", datasets=["raw/events"], ds=DS)

    assert (sensor.poke_interval, sensor.timeout) == (7, 90)


# --- validation operator and its link ----------------------------------------------------------------------


def test_operator_pushes_summary_then_fails_and_quarantines(root: Path) -> None:
    part = land(root, "raw/users")  # "PAR1" is not a Parquet file
    ti = FakeTI()
    op = ValidatePartitionOperator(task_id="validate_users", dataset="users", ds=DS)

    with pytest.raises(DataError) as err:
        op.execute(context(ti))

    summary = ti.xcom["validation"]
    assert summary["success"] is False and summary["failed_checks"] == ["files.readable"]
    assert summary["quarantine"] and Path(summary["quarantine"], "data", storage.DATA_FILE).exists()
    assert not Path(part).exists()
    message = str(err.value)
    assert "raw/users partition ds=2024-05-01" in message and "files.readable" in message
    assert storage.join(part, storage.DATA_FILE) in message and "Quarantined" in message
    # An http(s) link (the UI shows no other): the plugin serves the report from the storage root.
    link = DataDocsLink().get_link(op, ti_key=None)  # type: ignore[arg-type]
    assert link == op.data_docs_url and link.startswith("http") and link.endswith("/pinflow/data-quality/report/users/" + DS)
    assert Path(unquote(summary["data_docs"])).exists() and summary["data_docs"].endswith("index.html")


def test_operator_on_an_object_store_fails_and_quarantines(memory_root: str) -> None:
    part = land(memory_root, "raw/pins")
    ti = FakeTI()
    op = ValidatePartitionOperator(task_id="validate_pins", dataset="pins", ds=DS)

    with pytest.raises(DataError, match="files.readable"):
        op.execute(context(ti))

    summary = ti.xcom["validation"]
    assert summary["quarantine"].startswith(storage.join(memory_root, "quarantine", "pins", f"ds={DS}"))
    assert storage.list_names(storage.join(summary["quarantine"], "data")) == [storage.MARKER, storage.DATA_FILE]
    assert not storage.is_dir(part)
    assert storage.read_json(summary["report_path"])["failed_checks"] == ["files.readable"]
    assert summary["data_docs"].startswith("memory://")  # the report, wherever the root is
    assert op.data_docs_url.endswith(f"/pinflow/data-quality/report/pins/{DS}")  # served by the plugin over HTTP


def test_invalid_validation_settings_are_a_user_error(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINFLOW_VALIDATION__MIN_HISTORY_DAYS", "30")  # more than history_days
    config.load.cache_clear()
    land(root, "raw/users")

    with pytest.raises(UserError, match="min_history_days=30 must be at most history_days=7") as err:
        ValidatePartitionOperator(task_id="validate_users", dataset="users", ds=DS).execute(context(FakeTI()))

    assert not isinstance(err.value, DataError)
    assert storage.is_complete(root, "raw/users", DS)  # nothing was judged, nothing moved


def test_link_without_a_run_points_at_the_partition_report(root: Path) -> None:
    op = ValidatePartitionOperator(task_id="validate_events", dataset="events", ds=DS)

    link = DataDocsLink().get_link(op, ti_key=None)  # type: ignore[arg-type]

    # The plugin's page of the partition, which serves its Data Docs or else its report (pinflow_ui.web).
    assert link.startswith("http") and link.endswith(f"/pinflow/data-quality/report/events/{DS}")


def test_plugin_registers_the_link_for_the_validation_operator() -> None:
    import runpy

    plugin = runpy.run_path(str(Path(__file__).resolve().parents[2] / "plugins" / "pinflow_plugin.py"))
    [link] = [x for x in plugin["PinflowPlugin"].operator_extra_links if type(x).__name__ == "DataDocsLink"]
    assert link.name == "Data Docs" and link.xcom_key == "_link_DataDocsLink"
    assert any(type(x).__name__ == "DataDocsLink" for x in ValidatePartitionOperator.operator_extra_links)


def test_serialized_dag_keeps_the_link() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags["pin_daily_features"]
    task = DagSerialization.from_dict(DagSerialization.to_dict(dag)).get_task("validate_events")

    assert [link.name for link in task.operator_extra_links] == ["Data Docs"]
    # The API server answers with the URL the worker stored (it cannot call get_link on a serialized task).
    assert [type(link).__name__ for link in task.operator_extra_links] == ["XComOperatorLink"]
    assert getattr(dag.get_task("wait_for_raw"), "deferrable", None) is True


# --- window gaps -------------------------------------------------------------------------------------------


def _window_root(root: Path | str) -> None:
    for ds in ("2024-04-27", "2024-04-28", "2024-04-30"):
        land(root, "raw/events", ds)
    storage.write_json(storage.join(root, "quarantine", "events", "ds=2024-04-29", "20240429T000000Z", "QUARANTINE.json"), {})


@pytest.mark.parametrize("policy", ["fail", "proceed"])
def test_window_gap_policy(root: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    monkeypatch.setenv("PINFLOW_VALIDATION__ON_WINDOW_GAP", policy)
    config.load.cache_clear()
    _window_root(root)
    ti = FakeTI()
    op = WindowGapCheckOperator(task_id="validate_window", ds=DS)

    if policy == "fail":
        with pytest.raises(DataError, match=r"2024-04-29 \(quarantined: 2024-04-29\)"):
            op.execute(context(ti))
    else:
        assert op.execute(context(ti))["gaps"] == ["2024-04-29"]
    gaps = ti.xcom["window_gaps"]
    # Days before the first known day are not gaps: history starts there.
    assert gaps["gaps"] == ["2024-04-29"] and gaps["history_start"] == "2024-04-27" and gaps["policy"] == policy


def test_window_gaps_on_an_object_store(memory_root: str) -> None:
    from features.validation.window import window_gaps

    _window_root(memory_root)

    gaps = window_gaps(memory_root, DS, 30)

    assert gaps["gaps"] == ["2024-04-29"] and gaps["quarantined"] == ["2024-04-29"]
    assert gaps["history_start"] == "2024-04-27"


def test_window_gap_policy_is_checked(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINFLOW_VALIDATION__ON_WINDOW_GAP", "ignore")
    config.load.cache_clear()

    with pytest.raises(UserError, match="validation.on_window_gap = 'ignore'"):
        WindowGapCheckOperator(task_id="validate_window", ds=DS).execute(context(FakeTI()))


@pytest.mark.parametrize(("shards", "buckets"), [(None, 0), ("", 0), (1, 0), (4, 64)])
def test_events_are_bucketed_when_the_runs_build_is_sharded(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                            shards: Any, buckets: int) -> None:
    import features.validate

    asked: list[int] = []

    def validate(*args: Any, event_buckets: int, **kwargs: Any) -> Any:
        asked.append(event_buckets)
        raise DataError("stop here")

    monkeypatch.setattr(features.validate, "validate_partition", validate)
    op = ValidatePartitionOperator(task_id="validate_events", dataset="events", ds=DS, shards=shards)
    with pytest.raises(DataError, match="stop here"):
        op.execute(context(FakeTI()))
    assert asked == [buckets]  # the form's shards, else features.shards (1 here)


def test_the_day_is_skipped_when_its_events_were_quarantined_and_held_on_another_failure(root: Path) -> None:
    """Skipped (the next days build over it as a day without events) only when the day's raw events were quarantined;
    a quarantined pins snapshot, which the next days' features read, or a validation that could not run: failed,
    and the next days wait for this day."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowSkipException

    from core.contracts import RAW_EVENTS
    from features.validation.report import quarantine_root
    from operators.validation import gate_on_validations

    ds = "2026-11-02"
    states = {"validate_events": "success", "validate_pins": "success", "validate_users": "success",
              "validate_window": "success"}
    ti = SimpleNamespace(get_task_states=lambda dag_id, task_ids, run_ids: {"r": {t: states[t] for t in task_ids}})
    context: Any = {"dag_run": SimpleNamespace(dag_id="pin_daily_features", run_id="r"), "ti": ti}
    def gate() -> None:
        gate_on_validations(context, ds, sorted(states))

    gate()  # every validation passed: the build runs

    states["validate_pins"] = "failed"
    import pyarrow as pa

    from core.contracts import EVENTS_SCHEMA

    storage.write_table(root, RAW_EVENTS, ds, pa.Table.from_pylist([], schema=EVENTS_SCHEMA))  # the events passed
    Path(quarantine_root(root, "pins", ds), "20261102T010000Z").mkdir(parents=True)
    with pytest.raises(DataError, match=r"validate_pins \(failed\): nothing is built, and the next days' builds wait"):
        gate()

    states["validate_events"] = "failed"
    storage.remove_tree(storage.partition(root, RAW_EVENTS, ds))
    Path(quarantine_root(root, "events", ds), "20261102T010000Z").mkdir(parents=True)
    with pytest.raises(AirflowSkipException, match="its raw events were quarantined: the day's build is skipped"):
        gate()
