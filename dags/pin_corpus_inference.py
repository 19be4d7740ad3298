"""Corpus inference DAG: plan shards → score each shard (mapped, resumable) → publish the manifest."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from core import config
from operators.assets import CHAMPION_MODEL_ASSET, CORPUS_SCORES_ASSET
from operators.errors import retry_policy

with DAG(
    dag_id="pin_corpus_inference",
    doc_md="""
### Pin corpus inference

Runs when a model version is promoted to `champion` (or from the trigger form for any version). Scores
every pin of the corpus snapshot in shards (one mapped task per shard; a finished shard is never scored
again, so a retry or rerun resumes), then publishes
`inference/<model>/<version>/ds=<day>/part-NNNNN.parquet` with `_MANIFEST.json` written last: readers
use only manifested outputs.
""",
    schedule=[CHAMPION_MODEL_ASSET],
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["pinflow", "inference"],
    default_args={
        "owner": "ml-eng",
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": 2.0,
        "retry_policy": retry_policy(),
    },
    params={
        "model_version": Param("champion", type="string", description="A version number, or the alias 'champion'."),
        "ds": Param(None, type=["null", "string"], format="date", description="Pin corpus snapshot day (default: newest)."),
        "shards": Param(config.load().inference.shards, type="integer", minimum=1, maximum=4096, description="Shards of the corpus."),
    },
    render_template_as_native_obj=True,
) as dag:

    @task(retries=0)
    def plan_shards(params: dict | None = None) -> list[dict]:
        from operators.inference import plan_inference

        assert params is not None
        return plan_inference(str(params["model_version"]), params["ds"], int(params["shards"]))

    @task(max_active_tis_per_dag=2)
    def score_shard(work: dict) -> dict:
        from operators.inference import score_shard as run_shard

        return run_shard(work)

    @task(outlets=[CORPUS_SCORES_ASSET])
    def publish(shard_results: list) -> dict:
        from operators.inference import publish

        return publish(list(shard_results))

    publish(score_shard.expand(work=plan_shards()))  # type: ignore[arg-type]  # resolved at run time
