"""The training job on an ``s3://`` storage root: a moto S3 server over HTTP, real ``torchrun`` with two processes.

The examples, RUN.json, the checkpoints (DCP through fsspec), ``mlflow_run.json``, the heartbeats and
``result.json`` all live in the bucket; the job finds the server through ``AWS_ENDPOINT_URL_S3``, as a
job on AWS Batch or Kubernetes finds S3 through its environment. A first launch trains one epoch; a second
launch of two epochs resumes from the S3 checkpoint and ends bitwise equal to an uninterrupted local run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import s3_bucket
from test_train_torchrun import (  # the local kill-and-resume test's run helpers and tiny world
    assert_bitwise_equal,
    final_state,
    run,
    run_config,
    world,  # noqa: F401 - a fixture
)

from core.failures import ExitCode

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("world")]

BUCKET = "pinflow-test"
PREFIX = f"s3://{BUCKET}/pinflow"
LAUNCH = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config"]
# The LR schedule must not depend on total_steps (min_lr_ratio=1: warmup, then flat), so that a one-epoch
# run continued to two epochs trains exactly what a two-epoch run does.
COMMON = {
    "strategy": "ddp",
    "deterministic": True,
    "register": False,
    "params": {"ablation": False},
    "epochs": 2,
    "batch_size": 16,
    "checkpoint_every": 4,
    "keep_checkpoints": 1,
    "min_lr_ratio": 1.0,
    "heartbeat_every_s": 0.5,
    "min_steps": 0,  # short on purpose: exactly the epochs asked for
}


@pytest.fixture
def s3(moto_server: str, tmp_path: Path):
    """A bucket on the moto server, and the AWS variables (inherited by the job) that lead there."""
    with s3_bucket(moto_server, tmp_path, BUCKET) as fs:
        yield fs


def test_training_on_s3_checkpoints_resumes_and_equals_a_local_run(tmp_path: Path, s3):
    from training.checkpoint import MARKER, complete_checkpoints, latest_checkpoint

    s3.put(f"{tmp_path / 'storage'}/", f"{BUCKET}/pinflow/storage", recursive=True)
    assert s3.exists(f"{BUCKET}/pinflow/storage/examples/ds=2026-01-01/_SUCCESS")

    # Uninterrupted, on local paths.
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = run([*LAUNCH, str(run_config(straight, **COMMON, root=str(tmp_path / "storage")))])
    assert proc.returncode == 0, proc.stderr[-4000:]

    # On S3: the operator's way, RUN.json beside the job's files in the bucket.
    remote = tmp_path / "remote"
    remote.mkdir()
    urls = {
        "root": f"{PREFIX}/storage",
        "output_dir": f"{PREFIX}/jobs/train-1",
        "checkpoint_dir": f"{PREFIX}/models/pin_ranker/run-1/checkpoints",
    }
    config = f"{PREFIX}/jobs/train-1/RUN.json"
    s3.pipe_file(config, run_config(remote, **{**COMMON, **urls, "epochs": 1}).read_bytes())
    proc = run([*LAUNCH, config])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" not in proc.stderr
    first = json.loads(s3.cat_file(f"{urls['output_dir']}/result.json"))
    marker = latest_checkpoint(urls["checkpoint_dir"])
    assert marker is not None and marker["step"] == first["steps"] and marker["epoch"] == 0
    assert marker["path"] == f"{urls['checkpoint_dir']}/step-{first['steps']:08d}"
    assert s3.exists(f"{marker['path']}/{MARKER}") and s3.exists(f"{marker['path']}/.metadata")
    assert len(complete_checkpoints(urls["checkpoint_dir"])) == 1  # keep_checkpoints=1 pruned the others
    assert s3.exists(f"{urls['checkpoint_dir']}/mlflow_run.json")

    # The same job with a second epoch: resumes from the S3 checkpoint, trains only the second epoch.
    s3.pipe_file(config, run_config(remote, **COMMON, **urls).read_bytes())
    proc = run([*LAUNCH, config])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {marker['path']} at step {first['steps']}" in proc.stderr
    assert "not an exact resume" not in proc.stderr
    result = json.loads(s3.cat_file(f"{urls['output_dir']}/result.json"))
    assert result["mlflow_run_id"] == first["mlflow_run_id"]  # mlflow_run.json in the bucket: the same MLflow run
    for rank in (0, 1):
        beat = json.loads(s3.cat_file(f"{urls['output_dir']}/heartbeat-rank{rank}.json"))
        assert beat["rank"] == rank and beat["phase"] == "done" and beat["step"] == result["steps"]
    assert not s3.glob(f"{urls['output_dir']}/failure-rank*.json")

    expected = json.loads((straight / "job" / "result.json").read_text())
    assert result["steps"] == expected["steps"] > first["steps"]
    assert result["examples_seen"] == expected["examples_seen"]
    assert result["metrics"]["auc"] == expected["metrics"]["auc"]
    assert result["metrics"]["oracle_auc"] == expected["metrics"]["oracle_auc"] != {}  # truth/ read from S3 too
    downloaded = tmp_path / "downloaded"
    s3.get(f"{urls['checkpoint_dir']}/", str(downloaded), recursive=True)
    a = final_state(straight / "checkpoints", tmp_path, "straight")
    b = final_state(downloaded, tmp_path, "s3")
    assert a["step"] == b["step"] == result["steps"]
    assert_bitwise_equal(a, b)  # model, optimizer, scheduler, data position, RNG states


def test_preflight_on_s3_probes_the_bucket_and_skips_free_space(tmp_path: Path, s3):
    s3.put(f"{tmp_path / 'storage'}/", f"{BUCKET}/pinflow/storage", recursive=True)
    config = run_config(
        tmp_path,
        root=f"{PREFIX}/storage",
        output_dir=f"{PREFIX}/jobs/preflight",
        checkpoint_dir=f"{PREFIX}/models/pin_ranker/preflight/checkpoints",
    )
    launch = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.preflight", "--config"]
    proc = run([*launch, str(config), "--min-bus-gbps", "0"])
    assert proc.returncode == ExitCode.OK, proc.stderr[-4000:]
    report = json.loads(s3.cat_file(f"{PREFIX}/jobs/preflight/preflight.json"))
    for rank in report["ranks"]:
        disk = rank["checks"]["disk"]
        assert disk["ok"] and disk["writable"] and disk["free_gb"] is None and "object store" in disk["note"]
    data = report["ranks"][0]["checks"]["data"]
    assert data["ok"] and data["train_rows"] == 320 and data["read_rows"] > 0
    assert not s3.glob(f"{BUCKET}/pinflow/models/pin_ranker/preflight/checkpoints/.preflight-*")
