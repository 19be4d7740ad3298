"""``pinflow_rollback`` through Airflow (``dag.test()`` in a subprocess, this file its driver, on the session's
metadata database): the champion moves back, the move is recorded, and the champion asset event that starts
corpus inference names the family and the restored version; a version the model does not have fails the task as
a USER error and moves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def main() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["pinflow_rollback"]
    dr = dag.test(run_conf=json.loads(sys.argv[1]))
    with create_session() as session:
        events = [e.extra for e in session.query(AssetEvent).filter(AssetEvent.source_run_id == dr.run_id)]
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    print("SUMMARY " + json.dumps({"state": str(dr.state), "tasks": states, "events": events}), flush=True)


# -- the test ------------------------------------------------------------------------------------------------
@pytest.fixture
def registry_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A registry with versions 1 and 2 of pin_ranker, each promoted in turn: version 2 the champion."""
    from core import config
    from services import champions
    from services import model_registry as registry

    env = {"PINFLOW_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PINFLOW_JOB_HISTORY__URL": f"sqlite:///{tmp_path / 'history.db'}"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    client = registry.client(config.load().mlflow)
    client.create_registered_model("pin_ranker")
    experiment = client.create_experiment("x")
    for _ in range(2):
        run = client.create_run(experiment).info
        client.create_model_version("pin_ranker", f"runs:/{run.run_id}/model", run_id=run.run_id)
    for version in ("1", "2"):  # each promoted in turn by a training run
        with champions.model_lock("pin_ranker") as conn:
            champions.move(client, "pin_ranker", version, kind="promotion", moved_by=f"pin_ranker_training/run-{version}",
                           reason="better", conn=conn)
    return env


def drive(conf: dict, env: dict[str, str], log: Path) -> dict:
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, str(HERE), json.dumps(conf)], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **env}, cwd=REPO, timeout=600, check=False)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, text[-5000:]
    return json.loads(lines[-1].removeprefix("SUMMARY "))


def test_a_rollback_moves_the_champion_back_and_starts_rescoring_a_bad_one_moves_nothing(
    airflow_db, registry_env, tmp_path: Path
) -> None:
    from core import config
    from services import job_history
    from services import model_registry as registry

    client = registry.client(config.load().mlflow)
    bad = drive({"model": "pin_ranker", "to_version": "7", "reason": "typo"}, registry_env, tmp_path / "bad.log")
    assert bad["tasks"] == {"rollback": "failed"} and bad["events"] == []
    assert "pin_ranker (family pin_ranker) has no version 7: its versions are 1, 2" in (tmp_path / "bad.log").read_text()
    assert str(registry.champion(client, "pin_ranker").version) == "2" and len(job_history.alias_moves()) == 2

    good = drive({"model": "pin_ranker", "to_version": "1", "reason": "v2 ranks stale pins first"}, registry_env,
                 tmp_path / "good.log")
    assert good["state"] == "success" and good["tasks"] == {"rollback": "success"}
    assert good["events"] == [{"model": "pin_ranker", "model_version": "1"}]  # pin_corpus_inference re-scores with v1
    assert str(registry.champion(client, "pin_ranker").version) == "1"
    last = job_history.alias_moves("pin_ranker")[-1]
    assert (last["from_version"], last["to_version"], last["kind"]) == ("2", "1", "rollback")
    assert "via pinflow_rollback/" in last["moved_by"] and last["reason"] == "v2 ranks stale pins first"


if __name__ == "__main__":
    main()
