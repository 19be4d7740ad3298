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
    # OpenLineage's file transport: one JSON file per event under the test's PINFLOW_HOME (see test_lineage_*).
    events = pinflow_home / "openlineage"
    events.mkdir(exist_ok=True)
    transport = {"type": "file", "log_file_path": str(events / "event")}
    env = {**os.environ, "PINFLOW_TRAINING__PROCS_PER_NODE": "2", "PINFLOW_TRAINING__BATCH_SIZE": "128",
           "PINFLOW_TRAINING__MIN_STEPS": "0",  # a tiny world: one short epoch, as asked
           # Jobs of seconds: checked often (the defaults' 10 s would be most of each job's time). The nodes'
           # preflight runs through the training operator in test_training_operator, on its own in test_gpu_check.
           "PINFLOW_TRAINING__POLL_SECONDS": "1", "PINFLOW_INFERENCE__POLL_SECONDS": "1",
           "PINFLOW_FEATURES__POLL_SECONDS": "0.5", "PINFLOW_TRAINING__PREFLIGHT": "false",
           "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport), "AIRFLOW__OPENLINEAGE__NAMESPACE": "pinflow",
           # The demo puts the repository on sys.path, where `pip install -e .` left pinflow.egg-info: pinflow's
           # entry point is then seen twice, and the Task SDK 1.3 plugin loader stops at a duplicate name and drops
           # the entry-point plugins after it, the OpenLineage one included (apache/airflow#72253). Registering
           # the providers' plugins as well keeps the task-level listener.
           "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": "False"}
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
        [sys.executable, "-X", "faulthandler", str(REPO / "benchmarks" / "quality_ceiling.py"), "--root", str(root)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"  # (a CI run saw SIGABRT once)
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


def _lineage_events(pinflow_home: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((pinflow_home / "openlineage").glob("event-*.json"))]


@pytest.mark.e2e
def test_lineage_links_raw_data_to_features_to_model_to_corpus_scores(demo_run, pinflow_home):
    """OpenLineage's COMPLETE events (file transport) carry each stage's real inputs and outputs, and the output
    of each stage is an input of the next: raw → features → examples → registered model → corpus scores."""
    summary, root = demo_run
    complete = [e for e in _lineage_events(pinflow_home) if e["eventType"] == "COMPLETE"]
    tasks: dict[str, list[dict]] = {}
    for event in complete:
        tasks.setdefault(event["job"]["name"], []).append(event)
    assert {e["job"]["namespace"] for e in complete} == {"pinflow"}
    assert "pin_daily_features.validate_events" in tasks, f"no task-level COMPLETE event, only {sorted(tasks)}"

    def ids(event: dict, side: str) -> set[tuple[str, str]]:
        return {(d["namespace"], d["name"]) for d in event[side]}

    def local(path: str) -> tuple[str, str]:
        return "file", str(root / path)

    last, version = summary["last_day"], str(summary["model_version"])
    # Validation reads the raw partition and reports its checks.
    validate = [e for e in tasks["pin_daily_features.validate_events"] if local(f"raw/events/ds={last}") in ids(e, "inputs")]
    assert validate and validate[0]["inputs"][0]["inputFacets"]["dataQualityAssertions"]["assertions"]
    # raw → daily aggregates, sequences and examples (of ds, with the features of ds-1; one job) → window.
    built = tasks["pin_daily_features.daily_sequences_examples"]
    daily = [e for e in built if local(f"features/user_daily/ds={last}") in ids(e, "outputs")]
    assert daily and {local(f"raw/events/ds={last}"), local(f"raw/pins/ds={last}")} <= ids(daily[0], "inputs")
    examples = [e for e in built if local(f"examples/ds={last}") in ids(e, "outputs")]
    assert examples, [sorted(ids(e, "outputs")) for e in built]
    feature_outputs = {d for name, evs in tasks.items() if name.startswith("pin_daily_features.") for e in evs
                       for d in ids(e, "outputs")}
    assert ids(examples[0], "inputs") & feature_outputs & {d for d in ids(examples[0], "inputs") if "/features/" in d[1]}
    # examples → the registered model.
    train = [e for e in tasks["pin_ranker_training.train"]
             if any(d[1] == f"models/pin_ranker/{version}" for d in ids(e, "outputs"))]
    assert train, [sorted(ids(e, "outputs")) for e in tasks["pin_ranker_training.train"]]
    assert local(f"examples/ds={last}") in ids(train[0], "inputs")
    model = next(d for d in ids(train[0], "outputs") if d[1] == f"models/pin_ranker/{version}")
    # the model → the corpus scores.
    score = [e for e in tasks["pin_corpus_inference.score_shards"] if model in ids(e, "inputs")]
    assert score, [sorted(ids(e, "inputs")) for e in tasks["pin_corpus_inference.score_shards"]]
    assert local(f"raw/pins/ds={last}") in ids(score[0], "inputs")
    assert ids(score[0], "outputs") == {local(f"inference/pin_ranker/{version}/ds={last}")}

    # The whole chain as one graph: the scores are reachable from the raw events of the first day.
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for event in complete:
        for source in ids(event, "inputs"):
            edges.setdefault(source, set()).update(ids(event, "outputs"))
    seen, todo = set(), [local(f"raw/events/ds={summary['first_day']}")]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    assert local(f"inference/pin_ranker/{version}/ds={last}") in seen
