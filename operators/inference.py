"""Corpus inference stage: resolve the model and shards, run one scoring job per shard, publish."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from operators import config
from operators.errors import DataFailure, UserFailure


def plan_inference(model_version: str, ds: str | None, shards: int) -> list[dict[str, Any]]:
    """One work item per shard: which model version scores which slice of which corpus snapshot, where to."""
    from mlflow import MlflowClient

    from features.storage import complete_days, partition_path

    cfg = config.load()
    name = cfg["mlflow"]["model_name"]
    client = MlflowClient(tracking_uri=cfg["mlflow"]["tracking_uri"], registry_uri=cfg["mlflow"]["tracking_uri"])
    try:
        mv = (client.get_model_version(name, model_version) if model_version.isdigit()
              else client.get_model_version_by_alias(name, model_version))
    except Exception as err:  # noqa: BLE001 - MLflow raises MlflowException for an unknown version/alias
        raise UserFailure(f"model {name} version/alias {model_version!r} not found in the registry: {err}") from err
    days = complete_days(cfg["storage_root"], "raw/pins")
    ds = ds or (days[-1] if days else None)
    if ds is None or ds not in days:
        raise DataFailure(f"pin corpus snapshot raw/pins ds={ds} is missing or incomplete")
    out_dir = partition_path(cfg["storage_root"], f"inference/{name}/{mv.version}", ds)
    plan = {
        "model_name": name,
        "model_version": str(mv.version),
        "model_uri": f"models:/{name}/{mv.version}",
        "ds": ds,
        "shards": shards,
        "out_dir": str(out_dir),
    }
    return [{**plan, "shard": shard} for shard in range(shards)]


def score_shard(plan: dict[str, Any]) -> dict[str, Any]:
    """Score one shard as a job on the configured backend; a shard already written is not scored again."""
    from airflow.sdk import get_current_context

    from operators.backends import JobSpec, get_backend
    from operators.jobs import job_name, wait_for_job

    cfg = config.load()
    shard = int(plan["shard"])
    ti = get_current_context()["ti"]
    name = job_name("score", ti.dag_id, ti.run_id, f"shard{shard}", f"try{ti.try_number}")
    backend = get_backend(str(cfg["training"]["backend"]), cfg["home"])
    spec = JobSpec(
        name=name,
        team="ranking",
        command=[
            "-m", "training.inference",
            "--model-uri", plan["model_uri"], "--tracking-uri", cfg["mlflow"]["tracking_uri"],
            "--root", cfg["storage_root"], "--ds", plan["ds"],
            "--shard", str(shard), "--num-shards", str(plan["shards"]), "--out-dir", plan["out_dir"],
        ],
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=3600,
    )
    job_id = backend.find(name) or backend.submit(spec)
    wait_for_job(backend, job_id, poll_seconds=1.0, what=f"scoring job for shard {shard}")
    part = Path(plan["out_dir"]) / f"part-{shard:05d}.parquet"
    return {**plan, "part": str(part), "job_id": job_id}


def publish(shard_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the manifest last, once every shard is there: only then do readers see the output."""
    from training.inference import publish_manifest

    plan = shard_results[0]
    manifest = publish_manifest(plan["out_dir"], plan["shards"], plan["model_uri"], plan["ds"])
    summary = {k: v for k, v in manifest.items() if k != "parts"}
    return {**summary, "manifest": str(Path(plan["out_dir"]) / "_MANIFEST.json")}
