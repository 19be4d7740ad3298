"""The validation gate through Airflow: a corrupted day fails its validation task, is quarantined, and
nothing downstream runs; a day that never lands fails the deferrable sensor at its timeout. And the gate as a
container job on an ``s3://`` root (a moto S3 server over HTTP): ``python -m features.validate``.

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
START, BAD, NEXT = "2026-11-01", "2026-11-02", "2026-11-03"
DOWNSTREAM = ("daily_sequences_examples", "window_features")


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
    # The link as the API server answers the UI: from the serialized DAG in the database, not the operator.
    from airflow.models.serialized_dag import SerializedDagModel

    served = SerializedDagModel.get_dag(dag.dag_id)
    ti = next(t for t in dr.get_task_instances() if t.task_id == "validate_events")
    summary = {
        "state": str(dr.state),
        "states": states,
        "validation": xcoms.get(("validate_events", "validation")),
        "link": xcoms.get(("validate_events", "_link_DataDocsLink")),
        "served_link": served.get_task("validate_events").get_extra_links(ti, "Data Docs") if served else None,
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
def test_corrupted_day_is_quarantined_its_build_skipped_and_the_next_day_builds_over_the_gap(
    airflow_db, tmp_path: Path
) -> None:
    import pyarrow as pa

    from core import storage
    from features.synthetic import WorldConfig, generate_world

    root = tmp_path / "storage"
    generate_world(root, WorldConfig(start=START, days=3, users=60, pins=80, seed=3))
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
    # Skipped, not upstream_failed: the next day's depends_on_past steps would wait for ever on upstream_failed ones.
    for task_id in DOWNSTREAM:
        assert states[task_id] == "skipped", (task_id, states)
    assert states["validations_passed"] == "upstream_failed", states
    assert summary["state"] == "failed"
    # The summary was pushed before the failure; the link points at the partition's report page.
    validation = _value(summary["validation"])
    assert isinstance(validation, dict)
    assert validation["failed_checks"] == ["action.in_set"] and validation["quarantine"]
    link = _value(summary["link"])
    assert summary["served_link"] == link, summary  # the UI's button (was null: get_link ran on the serialized task)
    assert isinstance(link, str) and link.startswith("http") and link.endswith("/pinflow/data-quality/report/events/2026-11-02")
    assert "DataError" in log.read_text() and "action.in_set" in log.read_text()
    # Quarantined with its report; the other partitions stay; nothing downstream was written.
    record = Path(validation["quarantine"])
    assert (record / "data" / storage.MARKER).exists() and (record / "report" / "result.json").exists()
    assert not storage.is_dir(storage.partition(root, "raw/events", BAD))
    assert storage.is_complete(root, "raw/pins", BAD) and storage.is_complete(root, "raw/users", BAD)
    assert storage.is_complete(root, "raw/events", START)
    for dataset in ("features/user_daily", "features/pin_daily", "features/user_window", "examples"):
        assert not storage.is_dir(storage.partition(root, dataset, BAD)), dataset

    # The next day builds (validation.on_window_gap: proceed, the default), the quarantined day recorded as a gap.
    # Its window and sequences read the raw days before it, validated as the DAG's run of that day would have.
    from features.validate import main as validate

    for dataset in ("events", "pins", "users"):
        assert validate([dataset, "--root", str(root), "--ds", START, "--no-data-docs"]) == 0
    summary = drive(root, NEXT, tmp_path / "next.log")
    assert summary["state"] == "success", (summary["states"], (tmp_path / "next.log").read_text()[-6000:])
    assert all(summary["states"][task_id] == "success" for task_id in DOWNSTREAM), summary["states"]
    assert BAD in storage.read_metadata(root, "features/user_window", NEXT)["missing_days"]
    assert storage.is_complete(root, "examples", NEXT)



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
    assert {states[t] for t in ("validate_events", "validate_pins", "validate_users", *DOWNSTREAM[1:])} == {
        "upstream_failed"
    }, states
    # The day's first step runs however the validations ended: nothing was quarantined, so it fails (the next days
    # wait for this day) instead of skipping.
    assert states["daily_sequences_examples"] == "failed", states
    text = log.read_text()
    assert "DataError" in text and f"raw partitions of ds={BAD} did not land within 2 s" in text
    assert f"raw/events/ds={BAD} does not exist" in text


@pytest.mark.integration
def test_validation_command_on_an_s3_root(moto_server: str, tmp_path: Path) -> None:
    """The command as a job on AWS Batch or Kubernetes runs it: the root is a bucket, found through the AWS
    variables; the report, the Data Docs and the quarantine record land in the bucket."""
    import boto3
    import pyarrow as pa

    from core import storage
    from features.synthetic import WorldConfig, generate_world

    bucket = "pinflow-validation-test"
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL_S3": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    env.pop("AWS_PROFILE", None)
    local = tmp_path / "storage"
    generate_world(local, WorldConfig(start=START, days=2, users=60, pins=80, seed=3))
    events = storage.read_table(local, "raw/events", BAD)
    actions = events.column("action").to_pylist()
    actions[1] = "like"
    storage.write_table(
        local, "raw/events", BAD,
        events.set_column(events.schema.get_field_index("action"), "action", pa.array(actions, pa.string())),
    )
    client = boto3.client(
        "s3", endpoint_url=moto_server, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in (local / "raw").rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"pinflow/{path.relative_to(local).as_posix()}")
    root = f"s3://{bucket}/pinflow"

    def validate(ds: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "features.validate", "events", "--root", root, "--ds", ds, *extra],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )

    good = validate(START)
    bad = validate(BAD, "--quarantine", "--no-data-docs")

    assert good.returncode == 0, good.stderr[-4000:]
    report = f"pinflow/reports/validation/events/ds={START}"
    assert good.stdout.strip().splitlines()[-1] == f"s3://{bucket}/{report}/result.json"
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=report)["Contents"]}
    assert {f"{report}/result.json", f"{report}/profile.json", f"{report}/data_docs/index.html"} <= keys
    assert bad.returncode == 2, bad.stderr[-4000:]
    assert "action.in_set" in bad.stdout and "Quarantined" in bad.stdout
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"pinflow/raw/events/ds={BAD}/")
    assert listed["KeyCount"] == 0  # moved: copied, then deleted, the marker first
    moved = {o["Key"].split("/", 5)[-1] for o in client.list_objects_v2(
        Bucket=bucket, Prefix=f"pinflow/quarantine/events/ds={BAD}/")["Contents"]}
    assert {"data/_SUCCESS", f"data/{storage.DATA_FILE}", "report/result.json", "QUARANTINE.json"} <= moved
    client.delete_objects(Bucket=bucket, Delete={"Objects": [
        {"Key": o["Key"]} for o in client.list_objects_v2(Bucket=bucket)["Contents"]
    ]})


if __name__ == "__main__":
    main()
