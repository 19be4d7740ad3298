"""The whole chain through Airflow on a tiny synthetic world: what `make demo` runs, checked by what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_run(airflow_db, pinflow_home):
    env = {**os.environ, "PINFLOW_TRAINING__PROCS_PER_NODE": "2", "PINFLOW_TRAINING__BATCH_SIZE": "128"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--days", "4", "--users", "150", "--pins", "200",
         "--impressions-per-user", "20", "--train-days", "3",
         "--epochs", "1", "--no-quality-check"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    log = pinflow_home / "demo.log"
    assert proc.returncode == 0, (
        f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n"
        f"airflow log tail:\n{log.read_text()[-6000:] if log.exists() else ''}"
    )
    root = pinflow_home / "storage"
    return json.loads((root / "demo-summary.json").read_text()), root


@pytest.mark.e2e
def test_every_day_validated_and_built(demo_run):
    summary, root = demo_run
    assert summary["days"] == 4 and summary["days_validated"] == 4
    for ds in ("2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"):
        report = json.loads((root / "reports/validation/events" / f"ds={ds}" / "result.json").read_text())
        assert report["success"] is True
        for dataset in ("features/user_daily", "features/pin_window", "features/user_sequence", "examples"):
            assert (root / dataset / f"ds={ds}" / "_SUCCESS").exists(), (dataset, ds)
    assert summary["examples_train"] > 0 and summary["examples_eval"] > 0


@pytest.mark.e2e
def test_model_registered_and_evaluated(demo_run):
    summary, _ = demo_run
    from mlflow import MlflowClient

    from core import config

    uri = config.load().mlflow.tracking_uri
    version = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("pin_ranker", str(summary["model_version"]))
    assert version.status == "READY"
    for head in ("click", "repin", "hide"):
        assert 0.0 <= summary["auc"][head] <= 1.0
        assert 0.5 < summary["oracle_auc"][head] <= 1.0
        ratio = (summary["auc"][head] - 0.5) / (summary["oracle_auc"][head] - 0.5)
        assert summary["oracle_ratio"][head] == pytest.approx(ratio)
        assert head in summary["ablation_auc"]
    assert isinstance(summary["quality_bar_met"], bool)


@pytest.mark.e2e
def test_both_families_trained_registered_and_scored_every_pin(demo_run):
    summary, root = demo_run
    from mlflow import MlflowClient

    from core import config

    content = summary["content"]
    uri = config.load().mlflow.tracking_uri
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.get_model_version("pin_content", str(content["model_version"])).status == "READY"
    assert set(content["auc"]) == set(content["oracle_auc"]) == {"safety", "topic"}
    assert content["pins_scored"] == content["corpus_pins"] == summary["corpus_pins"]
    out = root / "inference/pin_content" / str(content["model_version"]) / "ds=2026-11-04"
    scores = pq.read_table(sorted(out.glob("part-*.parquet")), partitioning=None)
    assert scores.column_names == ["pin_id", "p_unsafe", "topic", "topic_probs", "embedding"]
    assert sorted(scores.column("pin_id").to_pylist()) == sorted(
        pq.read_table(root / "raw/pins/ds=2026-11-04").column("pin_id").to_pylist()
    )
    assert set(summary["stage_seconds"]) >= {"features", "pin_ranker_training", "pin_content_inference"}


@pytest.mark.e2e
def test_quality_ceiling_reads_the_demo_world(demo_run):
    _, root = demo_run
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "quality_ceiling.py"), "--root", str(root)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["eval_ds"] == "2026-11-04" and out["hides"] > 0
    # The category-level ceiling is a real signal, and below the oracle that also knows the finer taste.
    assert 0.5 < out["hide_category_ceiling_auc"] < out["hide_oracle_auc"]


@pytest.mark.e2e
def test_whole_corpus_scored_once(demo_run):
    summary, root = demo_run
    corpus = pq.read_table(root / "raw/pins/ds=2026-11-04").column("pin_id").to_pylist()
    assert summary["pins_scored"] == summary["corpus_pins"] == len(corpus) >= 200
    out = root / "inference/pin_ranker" / str(summary["model_version"]) / "ds=2026-11-04"
    manifest = json.loads((out / "_MANIFEST.json").read_text())
    pins = pq.read_table(sorted(out.glob("part-*.parquet"))).column("pin_id").to_pylist()
    assert sorted(pins) == sorted(corpus) and manifest["rows"] == len(corpus)


@pytest.mark.e2e
def test_demo_runs_say_which_day_they_built_and_start_when_they_ran(demo_run, airflow_db):
    import datetime as dt
    import sqlite3

    with sqlite3.connect(airflow_db) as con:
        runs = con.execute("SELECT dag_id, run_id, start_date, end_date FROM dag_run").fetchall()
    by_dag: dict[str, set[str]] = {}
    for dag_id, run_id, start, end in runs:
        by_dag.setdefault(dag_id, set()).add(run_id)
        # Started when it ran (not at its logical date weeks earlier): it lasted minutes.
        duration = dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)
        assert dt.timedelta(0) <= duration < dt.timedelta(hours=1), (run_id, start, end)
    assert by_dag["pin_daily_features"] == {f"demo__2026-11-0{day}" for day in range(1, 5)}
    assert by_dag["pin_ranker_training"] == by_dag["pin_corpus_inference"] == {
        "demo__2026-11-04__pin_ranker", "demo__2026-11-04__pin_content",
    }


@pytest.mark.e2e
def test_listener_recorded_job_data(demo_run, pinflow_home):
    rows = [json.loads(line) for line in (pinflow_home / "jobdata" / "task_runs.jsonl").read_text().splitlines()]
    assert {r["dag_id"] for r in rows} == {"pin_daily_features", "pin_ranker_training", "pin_corpus_inference"}
    assert any(r["task_id"] == "train" and r["state"] == "success" for r in rows)
