"""``torchrun`` with two CPU processes trains, checkpoints, evaluates, registers; the corpus gets scored.

Real processes, a real gloo process group, a real MLflow store (SQLite in tmp_path). Tiny sizes: a few
hundred examples over two days, a small model, one thread per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from features.storage import read_table
from training.failures import ExitCode
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN_DAYS = ["2026-01-01", "2026-01-02"]
EVAL_DS = "2026-01-03"


def run_config(tmp_path: Path, **overrides) -> Path:
    config = {
        "root": str(tmp_path / "storage"),
        "train_days": TRAIN_DAYS,
        "eval_ds": EVAL_DS,
        "output_dir": str(tmp_path / "job"),
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow_artifact_location": str(tmp_path / "artifacts"),
        "experiment": "pin_ranker_test",
        "model_name": "pin_ranker_test",
        "run_name": "integration",
        "epochs": 2,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup_steps": 2,
        "checkpoint_every": 4,
        "heartbeat_every_s": 0.2,
        "log_every": 2,
        "num_workers": 0,
        "sequence_length": 16,
        "first_k": 2,
        "d_model": 16,
        "ff_dim": 32,
        "pin_buckets": 503,
        "user_buckets": 503,
        "creator_buckets": 101,
        "category_buckets": 31,
        "mlp_hidden": [32],
        **overrides,
    }
    path = tmp_path / "RUN.json"
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    return write_tiny_world(
        tmp_path / "storage", [*TRAIN_DAYS, EVAL_DS], rows_per_day=160, pins=90, row_group_size=40, max_sequence=20
    )


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_torchrun_trains_registers_and_the_corpus_is_scored_once(tmp_path: Path, world):
    from mlflow import MlflowClient

    from training.inference import MANIFEST, publish_manifest, score_shard
    from training.inference import main as inference_main

    config = run_config(tmp_path)
    proc = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "training.train",
            "--config",
            str(config),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    job = tmp_path / "job"
    result = json.loads((job / "result.json").read_text())
    assert result["model_name"] == "pin_ranker_test"
    assert result["model_version"] == "1"
    assert result["model_uri"] == "models:/pin_ranker_test/1"
    assert result["steps"] > 0 and result["examples_seen"] > 0 and result["seconds"] > 0
    metrics = result["metrics"]
    assert metrics["examples"] == 160
    for key in ("auc", "baseline_auc", "oracle_auc", "logloss", "calibration"):
        assert set(metrics[key]) == {"click", "repin", "hide"}, key
    for rank in (0, 1):
        beat = json.loads((job / f"heartbeat-rank{rank}.json").read_text())
        assert beat["rank"] == rank and beat["world_size"] == 2
        assert beat["step"] == result["steps"]
        assert beat["phase"] == "done"
    assert not list(job.glob("failure-rank*.json"))
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert checkpoints[-1] == f"step-{result['steps']:08d}"
    assert all((tmp_path / "checkpoints" / name / "COMPLETE.json").exists() for name in checkpoints)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version("pin_ranker_test", "1")
    assert version.run_id == result["mlflow_run_id"]
    mlflow_run = client.get_run(result["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["eval_ds"] == EVAL_DS
    assert "eval_auc_click" in mlflow_run.data.metrics and "eval_mean_auc" in mlflow_run.data.metrics
    assert len(client.get_metric_history(result["mlflow_run_id"], "train_loss")) >= 2
    assert (tmp_path / "artifacts").is_dir()  # the experiment's artifact location

    # Corpus inference: shard 0 through the CLI, shard 1 in process, then a rerun that skips.
    out = tmp_path / "inference"
    common = [
        "--model-uri",
        result["model_uri"],
        "--tracking-uri",
        uri,
        "--root",
        str(tmp_path / "storage"),
        "--ds",
        EVAL_DS,
        "--num-shards",
        "2",
        "--out-dir",
        str(out),
    ]
    proc = run(["-m", "training.inference", *common, "--shard", "0"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["shard"] == 0 and line["skipped"] is False
    shard1 = score_shard(
        model_uri=result["model_uri"],
        tracking_uri=uri,
        root=str(tmp_path / "storage"),
        ds=EVAL_DS,
        shard=1,
        num_shards=2,
        out_dir=out,
    )
    assert shard1["skipped"] is False
    assert inference_main([*common, "--shard", "1"]) == 0  # already there: skipped

    manifest = publish_manifest(out, 2, result["model_uri"], EVAL_DS)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    scored = [p for part in manifest["parts"] for p in pq.read_table(out / part["file"]).column("pin_id").to_pylist()]
    corpus = read_table(tmp_path / "storage", "raw/pins", EVAL_DS, columns=["pin_id"]).column("pin_id").to_pylist()
    assert sorted(scored) == sorted(corpus)  # every pin exactly once
    assert manifest["rows"] == len(corpus) == line["rows"] + shard1["rows"]
    assert all(p % 2 == 0 for p in pq.read_table(out / "part-00000.parquet").column("pin_id").to_pylist())
    scores = pq.read_table(out / "part-00001.parquet").to_pandas()
    for label in ("p_click", "p_repin", "p_hide"):
        assert np.all((scores[label] > 0) & (scores[label] < 1))


def test_nan_loss_fails_every_rank_with_the_nan_exit_code(tmp_path: Path, world):
    config = run_config(tmp_path, fail_nan_at_step=2, checkpoint_every=0)
    proc = run(
        ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config", str(config)]
    )
    assert proc.returncode == ExitCode.NAN_LOSS, proc.stderr[-4000:]
    for rank in (0, 1):  # the NaN was injected on rank 1 only; the all-reduced check stops both
        failure = json.loads((tmp_path / "job" / f"failure-rank{rank}.json").read_text())
        assert failure["exit_code"] == ExitCode.NAN_LOSS
        assert failure["failure_class"] == "USER"
        assert "at step 2" in failure["message"]
    assert not (tmp_path / "job" / "result.json").exists()
