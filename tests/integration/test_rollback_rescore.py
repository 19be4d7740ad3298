"""A rollback leaves every pin of the corpus scored by the restored version (issue 36, 2).

On the corpus world (``corpus_inference_world``: 630 pins, version 1 of ``pin_content`` registered) with a registry
of this test's own: version 2 is registered, and versions 1 then 2 are promoted in turn. The driver (this file, in a
subprocess: ``dag.test()`` on the session's metadata database) then runs ``pinflow_rollback`` back to version 1 and,
with the family and version of the champion asset event that run emitted (what starts ``pin_corpus_inference`` under
the scheduler), ``pin_corpus_inference`` for the champion alias. Every pin is scored exactly once, by version 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpus_inference_world import DAYS, copy_root, register, shared_world

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def main() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    dags = DagBag(dag_folder=str(REPO / "dags")).dags
    rollback = dags["pinflow_rollback"].test(run_conf={"model": "pin_content", "to_version": "1",
                                                       "reason": "v2 hides safe pins"})
    with create_session() as session:
        [event] = [e.extra for e in session.query(AssetEvent).filter(AssetEvent.source_run_id == rollback.run_id)]
    # What the scheduler passes on: pin_corpus_inference scores the family's champion the event names.
    scoring = dags["pin_corpus_inference"].test(run_conf={"model": event["model"], "model_version": "champion",
                                                          "shards": 3})
    tis = {ti.task_id: ti for ti in scoring.get_task_instances()}
    print("SUMMARY " + json.dumps({
        "rollback": str(rollback.state), "event": event, "scoring": str(scoring.state),
        "plan": tis["plan_shards"].xcom_pull(task_ids="plan_shards"),
    }), flush=True)


# -- the test ------------------------------------------------------------------------------------------------
def test_a_rollback_rescores_every_pin_with_the_restored_version(airflow_db, tmp_path_factory, tmp_path):
    import pyarrow.parquet as pq

    from core import config
    from services import champions
    from services import model_registry as registry

    world = shared_world(tmp_path_factory)
    # A registry of this test's own (the world's is shared by the session): version 1 copied, version 2 added.
    shutil.copy(world.base / "mlflow.db", tmp_path / "mlflow.db")
    env = {"PINFLOW_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PINFLOW_JOB_HISTORY__URL": f"sqlite:///{tmp_path / 'history.db'}",
           "PINFLOW_HOME": str(tmp_path / "home"), "PINFLOW_STORAGE_ROOT": str(copy_root(world, tmp_path / "storage")),
           "PINFLOW_INFERENCE__POLL_SECONDS": "0.3", "OMP_NUM_THREADS": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        assert register("pin_content", world.root, tmp_path, env["PINFLOW_MLFLOW__TRACKING_URI"]).endswith("/2")
        client = registry.client(config.load().mlflow)
        for version in ("1", "2"):  # each promoted in turn by a training run
            with champions.model_lock("pin_content") as conn:
                champions.move(client, "pin_content", version, kind="promotion",
                               moved_by=f"pin_ranker_training/run-{version}", reason="better", conn=conn)

    log = tmp_path / "driver.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(HERE)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=900, check=False)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, log.read_text(errors="replace")[-6000:]
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    assert summary["rollback"] == "success" and summary["scoring"] == "success", summary
    assert summary["event"] == {"model": "pin_content", "model_version": "1"}
    assert summary["plan"]["model_version"] == "1", summary["plan"]  # the alias resolved to the restored version

    out = tmp_path / "storage" / "inference" / "pin_content" / "1" / f"ds={DAYS[-1]}"
    manifest = json.loads((out / "_MANIFEST.json").read_text())
    assert manifest["model_uri"] == "models:/pin_content/1"
    ids = [pin for part in manifest["parts"] for pin in pq.read_table(out / part["file"]).column("pin_id").to_pylist()]
    assert sorted(ids) == world.pin_ids and manifest["rows"] == manifest["pins"] == len(world.pin_ids)
    assert not (tmp_path / "storage" / "inference" / "pin_content" / "2").exists()  # v2 scored nothing here


if __name__ == "__main__":
    main()
