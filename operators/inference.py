"""Corpus inference stage: resolve the model and shards, run one scoring job per shard, publish."""

from __future__ import annotations

from typing import Any

from core import config
from core.contracts import INFERENCE, RAW_PINS
from core.failures import DataError


def plan_inference(model: str, model_version: str, ds: str | None, shards: int) -> list[dict[str, Any]]:
    """One work item per shard: which version of which family's model scores which slice of which corpus
    snapshot, where to.

    An unknown family, version or alias is a USER error; a registry that does not answer is INFRA (retried).
    """
    from core import storage
    from core.failures import ConfigError
    from operators import registry

    cfg = config.load()
    if model not in cfg.families:
        raise ConfigError(f"unknown model family {model!r} (param model): configured are {', '.join(sorted(cfg.families))}")
    name = cfg.families[model].model_name or model
    mv = registry.model_version(registry.client(cfg.mlflow), name, model_version)
    days = storage.complete_days(cfg.storage_root, RAW_PINS)
    ds = ds or (days[-1] if days else None)
    if ds is None or ds not in days:
        raise DataError(f"pin corpus snapshot {RAW_PINS} ds={ds} is missing or incomplete under {cfg.storage_root}")
    out_dir = storage.partition(cfg.storage_root, f"{INFERENCE}/{name}/{mv.version}", ds)
    plan = {
        "model": model,
        "model_name": name,
        "model_version": str(mv.version),
        "model_uri": f"models:/{name}/{mv.version}",
        "ds": ds,
        "shards": shards,
        "out_dir": out_dir,
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
    backend = get_backend(cfg.training.backend, cfg)
    spec = JobSpec(
        name=name,
        team=cfg.training.team,
        command=[
            "-m", "training.inference",
            "--model-uri", plan["model_uri"], "--tracking-uri", cfg.mlflow.tracking_uri,
            "--root", cfg.storage_root, "--ds", plan["ds"],
            "--shard", str(shard), "--num-shards", str(plan["shards"]), "--out-dir", plan["out_dir"],
        ],
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=3600,
        # Scoring is one CPU process per shard: not the team's (GPU) training node.
        instance_type=cfg.inference.instance_type,
    )
    job_id = backend.find(name) or backend.submit(spec)
    wait_for_job(backend, job_id, poll_seconds=1.0, what=f"scoring job for shard {shard}")
    from core.storage import join
    from training.inference import part_name

    return {**plan, "part": join(plan["out_dir"], part_name(shard)), "job_id": job_id}


def publish(shard_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the manifest last, once every shard is there: only then do readers see the output."""
    from core.storage import join
    from training.inference import MANIFEST, publish_manifest

    plan = shard_results[0]
    manifest = publish_manifest(plan["out_dir"], plan["shards"], plan["model_uri"], plan["ds"])
    summary = {k: v for k, v in manifest.items() if k != "parts"}
    return {**summary, "manifest": join(plan["out_dir"], MANIFEST)}
