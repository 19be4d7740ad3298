"""The validation gate through Airflow: a corrupted day fails its validation task, is quarantined, and
nothing downstream runs; a day that never lands fails the deferrable sensor at its timeout.

``pin_daily_features`` runs with ``dag.test()`` in a subprocess (this file is also its driver:
``python test_validation_dag.py STORAGE_ROOT DS``) against the session's Airflow metadata database and a
private storage root; the test then checks the task states, XComs and what is on disk.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
START, BAD = "2026-11-01", "2026-11-02"
DOWNSTREAM = ("daily_aggregates", "window_features", "user_sequences", "training_examples")


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def main() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    ds = sys.argv[2]
    dag = DagBag(dag_folder=str(REPO / "dags")).dags["pin_daily_features"]
    day = dt.datetime.fromisoformat(ds).replace(tzinfo=dt.UTC)
    dr = dag.test(logical_date=day, run_conf={"ds": ds})
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    with create_session() as session:
        xcoms = {
            (x.task_id, x.key): x.value
            for x in session.query(XComModel).filter(XComModel.dag_id == dag.dag_id, XComModel.run_id == dr.run_id)
        }
    summary = {
        "state": str(dr.state),
        "states": states,
        "validation": xcoms.get(("validate_events", "validation")),
        "link": xcoms.get(("validate_events", "_link_DataDocsLink")),
        "pins_validation": xcoms.get(("validate_pins", "validation")),
    }
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)


# -- the test ------------------------------------------------------------------------------------------------
def drive(root: Path, ds: str, log: Path, **env_overrides: str) -> dict:
    env = {**os.environ, "PINFLOW_STORAGE_ROOT": str(root), **env_overrides}
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(HERE), str(root), ds], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO, timeout=600)
    lines = [line for line in log.read_text().splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"driver printed no summary (exit {proc.returncode}):\n{log.read_text()[-6000:]}"
    return json.loads(lines[-1][len("SUMMARY "):])


def _value(raw: object) -> object:
    """An XCom value as read from the metadata database (JSON text, or already decoded)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


@pytest.mark.integration
def test_corrupted_day_is_quarantined_and_nothing_downstream_runs(airflow_db, tmp_path: Path) -> None:
    import pyarrow as pa

    from features import storage
    from features.synthetic import WorldConfig, generate_world

    root = tmp_path / "storage"
    generate_world(root, WorldConfig(start=START, days=2, users=60, pins=80, seed=3))
    events = storage.read_table(root, "raw/events", BAD)
    actions = events.column("action").to_pylist()
    actions[1] = "like"
    events = events.set_column(events.schema.get_field_index("action"), "action", pa.array(actions, pa.string()))
    storage.write_table(root, "raw/events", BAD, events)
    log = tmp_path / "driver.log"

    summary = drive(root, BAD, log)
    states = summary["states"]

    assert states["wait_for_raw"] == "success"
    assert states["validate_events"] == "failed", states
    assert states["validate_pins"] == states["validate_users"] == states["validate_window"] == "success", states
    for task_id in DOWNSTREAM:
        assert states[task_id] == "upstream_failed", (task_id, states)
    assert summary["state"] == "failed"
    # The summary was pushed before the failure; the link points at the partition's report page.
    validation = _value(summary["validation"])
    assert isinstance(validation, dict)
    assert validation["failed_checks"] == ["action.in_set"] and validation["quarantine"]
    link = _value(summary["link"])
    assert isinstance(link, str) and link.startswith("file://") and "validation/events/ds%3D2026-11-02" in link
    assert "DataFailure" in log.read_text() and "action.in_set" in log.read_text()
    # Quarantined with its report; the other partitions stay; nothing downstream was written.
    record = Path(validation["quarantine"])
    assert (record / "data" / storage.MARKER).exists() and (record / "report" / "result.json").exists()
    assert not storage.partition_path(root, "raw/events", BAD).exists()
    assert storage.is_complete(root, "raw/pins", BAD) and storage.is_complete(root, "raw/users", BAD)
    assert storage.is_complete(root, "raw/events", START)
    for dataset in ("features/user_daily", "features/pin_daily", "features/user_window", "examples"):
        assert not storage.partition_path(root, dataset, BAD).exists(), dataset



@pytest.mark.integration
def test_partition_that_never_lands_fails_the_deferred_sensor(airflow_db, tmp_path: Path) -> None:
    from features.synthetic import WorldConfig, generate_world

    root = tmp_path / "storage"
    generate_world(root, WorldConfig(start=START, days=1, users=30, pins=40, seed=3))  # BAD never lands
    log = tmp_path / "driver.log"

    summary = drive(root, BAD, log, PINFLOW_VALIDATION__SENSOR_TIMEOUT_SECONDS="2",
                    PINFLOW_VALIDATION__SENSOR_POKE_SECONDS="1")

    states = summary["states"]
    assert states["wait_for_raw"] == "failed", states
    assert {states[t] for t in ("validate_events", "validate_pins", "validate_users", *DOWNSTREAM)} == {
        "upstream_failed"
    }, states
    text = log.read_text()
    assert "DataFailure" in text and f"raw partitions of ds={BAD} did not land within 2 s" in text
    assert f"raw/events/ds={BAD} does not exist" in text


if __name__ == "__main__":
    main()
