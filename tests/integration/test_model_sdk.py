"""The model SDK: the content family trains on the platform and scores the whole corpus; a third family, written
in one file under ``tests/families/`` and named in the configuration, trains through the training DAG with no
change anywhere else.

This file is also the driver of the DAG run (``python test_model_sdk.py run``), in a subprocess with the
configuration that adds the family.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
FAMILIES = REPO / "tests" / "families"
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03"]

pytestmark = pytest.mark.integration


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_the_content_family_trains_under_torchrun_and_scores_every_pin(tmp_path: Path):
    import pyarrow.parquet as pq

    from core import contracts, storage
    from training import inference
    from training.smoke_data import write_tiny_world

    root = tmp_path / "storage"
    write_tiny_world(root, DAYS, rows_per_day=40, pins=160, row_group_size=16)
    config = {
        "root": str(root), "train_days": DAYS[:-1], "eval_ds": DAYS[-1], "output_dir": str(tmp_path / "job"),
        "checkpoint_dir": str(tmp_path / "checkpoints"), "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'm.db'}",
        "mlflow_artifact_location": str(tmp_path / "artifacts"), "family": "pin_content", "epochs": 8, "min_steps": 0,
        "batch_size": 16, "lr": 0.01, "checkpoint_every": 5, "heartbeat_every_s": 0.5, "params": {"width": 32},
    }
    (tmp_path / "RUN.json").write_text(json.dumps(config))
    proc = run(["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train",
                "--config", str(tmp_path / "RUN.json")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    assert result["family"] == "pin_content" and result["model_uri"] == "models:/pin_content/1"
    metrics = result["metrics"]
    assert set(metrics["auc"]) == {"safety", "topic"} and metrics["examples"] == 80
    assert metrics["auc"]["topic"] > 0.8  # the topic shows plainly in the tiny world's content
    assert metrics["oracle_auc"]["topic"] == 1.0 and metrics["mean_auc"] is not None

    out = str(tmp_path / "scores")
    for shard in range(2):
        inference.score_shard(model_uri=result["model_uri"], tracking_uri=config["mlflow_tracking_uri"],
                              root=str(root), ds=DAYS[-1], shard=shard, num_shards=2, out_dir=out)
    manifest = inference.publish_manifest(out, 2, result["model_uri"], DAYS[-1])
    assert manifest["rows"] == 160 == storage.read_table(root, contracts.RAW_PINS, DAYS[-1]).num_rows
    assert manifest["columns"] == ["pin_id", "p_unsafe", "topic", "topic_probs", "embedding"]
    scores = pq.read_table(f"{out}/{inference.part_name(0)}")
    assert all(0.0 <= p <= 1.0 for p in scores.column("p_unsafe").to_pylist())
    assert len(scores.column("embedding")[0]) == 32


# -- a third family, through the training DAG ---------------------------------------------------------------
def _run_dag() -> dict:
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["pin_ranker_training"]
    assert "tiny_click" in dag.params.get_param("model").schema["enum"]
    dr = dag.test(run_conf={"model": "tiny_click", "train_days": 2, "epochs": 2, "batch_size": 32,
                            "nodes": 1, "procs_per_node": 1})
    from airflow.models.dagrun import DagRunNote
    from airflow.utils.session import create_session

    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    with create_session() as session:
        note = session.query(DagRunNote.content).filter(DagRunNote.dag_run_id == dr.id).scalar()
    return {"state": str(dr.state), "tasks": states,
            "promote": dr.get_task_instance("promote").xcom_pull(task_ids="promote"), "note": note}


def test_a_family_in_one_file_trains_through_the_training_dag(airflow_db, tmp_path: Path):
    from mlflow import MlflowClient

    from training.smoke_data import write_tiny_world

    home = tmp_path / "home"
    write_tiny_world(home / "storage", DAYS, rows_per_day=120)
    config = tmp_path / "platform.yaml"
    config.write_text(
        (REPO / "config" / "platform.yaml").read_text()
        + "\nfamilies:\n  tiny_click: {module: tiny_click, params: {hidden: 4}}\n"
    )
    env = {
        "PINFLOW_HOME": str(home), "PINFLOW_CONFIG": str(config), "PINFLOW_TRAINING__POLL_SECONDS": "0.5",
        "PINFLOW_TRAINING__PREFLIGHT": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(FAMILIES)]),
    }
    proc = run([str(HERE), "run"], env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"the DAG run printed no summary:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads(lines[-1][len("SUMMARY "):])
    assert summary["state"] == "success", summary
    assert summary["promote"]["promoted"] and summary["promote"]["model_name"] == "tiny_click"
    # The decision is the run's note too (operators.run_notes).
    assert summary["note"].startswith("**Promotion**: tiny_click version 1 promoted to champion"), summary["note"]

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias("tiny_click", "champion")
    run_tags = client.get_run(version.run_id).data.tags
    assert run_tags["pinflow.family"] == "tiny_click" and run_tags["pinflow.dag"] == "pin_ranker_training"
    assert client.get_experiment_by_name("tiny_click") is not None


if __name__ == "__main__":
    print("SUMMARY " + json.dumps(_run_dag(), default=str), flush=True)
