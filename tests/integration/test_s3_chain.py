"""The whole chain on an ``s3://`` storage root equals the same chain on a local root.

A moto S3 server over HTTP stands for S3. The same steps run on ``s3://<bucket>/pinflow`` and on a local
folder, through the same functions the DAGs' tasks and jobs call: a synthetic world is generated, every raw
partition validated (Great Expectations suite and history checks, reports and profiles written beside the
data), every day's features built (DuckDB reading through fsspec), the ranker trained by ``python -m
training.train`` (a world of one, deterministic), and the corpus scored in two shards by
``training.inference`` and published. Every report, feature table, metric and score must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import s3_bucket

from core import contracts, storage
from core.config import ValidationConfig
from features import build
from features.synthetic import WorldConfig, generate_world
from features.validate import validate_partition
from training import inference

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUCKET = "pinflow-chain"
WORLD = WorldConfig(start="2026-11-01", days=4, users=60, pins=80, seed=5, active_rate=0.9)
DAYS = WORLD.day_list
WINDOW = {"window_days": 2, "sequence_length": 6}
SHARDS = 2
TRAINING = {
    "epochs": 1, "batch_size": 64, "deterministic": True, "num_threads": 1, "register": True, "checkpoint_every": 0,
    "heartbeat_every_s": 1.0, "params": {"ablation": False, "sequence_length": WINDOW["sequence_length"]},
    "min_steps": 0,  # short on purpose: exactly the epochs asked for
}


def run_chain(root: str, home: Path) -> dict[str, Any]:
    """Every stage on ``root``; what each produced, read back from ``root``."""
    generate_world(root, WORLD)

    reports = {}
    for ds in DAYS:
        for dataset in contracts.RAW_DATASETS:
            report = validate_partition(root, dataset, ds, config=ValidationConfig(), data_docs=False, quarantine=True)
            reports[(dataset, ds)] = report
    for ds in DAYS:
        build.build_day(root, ds, **WINDOW)

    # Training as a job runs it: RUN.json and the job's files beside the data, MLflow local to the "cluster".
    job = storage.join(root, contracts.RUNS, "train-1")
    run_config = {
        "root": root, "train_days": DAYS[1:-1], "eval_ds": DAYS[-1], "output_dir": job,
        "checkpoint_dir": storage.join(root, contracts.MODELS, "pin_ranker", "run-1", "checkpoints"),
        "mlflow_tracking_uri": f"sqlite:///{home / 'mlflow.db'}", "mlflow_artifact_location": str(home / "artifacts"),
        **TRAINING,
    }
    storage.write_json(storage.join(job, "RUN.json"), run_config)
    proc = subprocess.run(
        [sys.executable, "-m", "training.train", "--config", storage.join(job, "RUN.json")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = storage.read_json(storage.join(job, "result.json"))

    out_dir = storage.partition(root, f"{contracts.INFERENCE}/pin_ranker/{result['model_version']}", DAYS[-1])
    for shard in range(SHARDS):
        inference.score_shard(
            model_uri=f"models:/pin_ranker/{result['model_version']}", tracking_uri=run_config["mlflow_tracking_uri"],
            root=root, ds=DAYS[-1], shard=shard, num_shards=SHARDS, out_dir=out_dir,
        )
    manifest = inference.publish_manifest(out_dir, SHARDS, f"models:/pin_ranker/{result['model_version']}", DAYS[-1])
    return {
        "validation": {key: _comparable(report) for key, report in reports.items()},
        "features": {(d, ds): storage.read_table(root, d, ds) for d in contracts.FEATURE_OUTPUTS for ds in DAYS},
        "result": result,
        "scores": [storage.read_parquet(storage.join(out_dir, inference.part_name(s))) for s in range(SHARDS)],
        "manifest": manifest,
        "corpus_pins": storage.read_table(root, contracts.RAW_PINS, DAYS[-1], columns=["pin_id"]).num_rows,
        "report_files": [
            storage.exists(storage.join(storage.partition(root, f"{contracts.VALIDATION_REPORTS}/{d}", ds), name))
            for d in contracts.RAW_DATASETS for ds in DAYS for name in ("result.json", "index.html", "profile.json")
        ],
    }


def _comparable(report: Any) -> dict[str, Any]:
    """A report's verdict and every check's observed value, without paths and times."""
    return {
        "success": report.success,
        "rows": report.rows,
        "checks": {c.name: (c.success, repr(c.observed), repr(c.expected)) for c in report.checks},
        "profile": report.profile,
    }


@pytest.fixture(scope="module")
def chains(moto_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    scratch = tmp_path_factory.mktemp("s3-chain")
    local = run_chain(str(scratch / "local" / "storage"), scratch / "local")
    with s3_bucket(moto_server, scratch, BUCKET) as fs:
        remote = run_chain(f"s3://{BUCKET}/pinflow/storage", scratch / "remote")
        # Nothing of the chain was written to the local disk but MLflow's own store.
        assert fs.exists(f"{BUCKET}/pinflow/storage/examples/ds={DAYS[-1]}/_SUCCESS")
        yield {"local": local, "s3": remote}


def test_validation_on_s3_equals_local(chains):
    local, remote = chains["local"], chains["s3"]
    assert remote["validation"] == local["validation"]
    assert all(v["success"] for v in remote["validation"].values())
    assert all(remote["report_files"])


def test_features_on_s3_equal_local(chains):
    local, remote = chains["local"], chains["s3"]
    for key, table in local["features"].items():
        assert remote["features"][key].equals(table), key
    assert local["features"][(contracts.EXAMPLES, DAYS[-1])].num_rows > 0


def test_training_and_inference_on_s3_equal_local(chains):
    local, remote = chains["local"], chains["s3"]
    for key in ("steps", "examples_seen"):
        assert remote["result"][key] == local["result"][key]
    assert remote["result"]["metrics"]["auc"] == local["result"]["metrics"]["auc"]
    assert remote["result"]["metrics"]["oracle_auc"] == local["result"]["metrics"]["oracle_auc"] != {}
    for a, b in zip(remote["scores"], local["scores"], strict=True):
        assert a.equals(b)
    assert remote["manifest"]["rows"] == local["manifest"]["rows"] == local["corpus_pins"] > 0
    assert json.dumps(remote["manifest"]["parts"]) == json.dumps(local["manifest"]["parts"])
