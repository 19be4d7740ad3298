"""Corpus inference DAG: plan shards → score each shard (mapped, resumable) → publish the manifest."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pendulum
from airflow.sdk import DAG, Param, task

from core import config
from operators.assets import CHAMPION_MODEL_ASSET, CORPUS_SCORES_ASSET
from operators.errors import retry_policy

_cfg = config.load()

with DAG(
    dag_id="pin_corpus_inference",
    doc_md="""
### Pin corpus inference

Scores the whole pin corpus with a model of any family that scores it (`model`: `pin_content` writes each
pin's `p_unsafe`, topic distribution and content embedding; `pin_ranker` each pin's prior engagement
probabilities in a non-personalised context). Runs when a family's model version is promoted to `champion`
(the promotion's asset event names the family and version), or from the trigger form for any family and
version. Scores every pin of the corpus snapshot in shards (one mapped task per shard; a finished shard is never scored
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
        "model": Param(_cfg.training.model, enum=sorted(_cfg.families), description="The model family whose model scores the corpus."),
        "model_version": Param("champion", type="string", description="A version number, or the alias 'champion'."),
        "ds": Param(None, type=["null", "string"], format="date", description="Pin corpus snapshot day (default: newest)."),
        "shards": Param(_cfg.inference.shards, type="integer", minimum=1, maximum=4096, description="Shards of the corpus."),
    },
    render_template_as_native_obj=True,
) as dag:

    @task(retries=0)
    def plan_shards(params: dict | None = None, triggering_asset_events: Any = None) -> list[dict]:
        from operators.inference import plan_inference

        assert params is not None
        model, version = str(params["model"]), str(params["model_version"])
        events = [event for events in (triggering_asset_events or {}).values() for event in events]
        if events:  # started by a promotion: score with the champion it made, of its family
            extra = events[-1].extra or {}
            model, version = str(extra.get("model", model)), str(extra.get("model_version", version))
        return plan_inference(model, version, params["ds"], int(params["shards"]))

    @task(max_active_tis_per_dag=2)
    def score_shard(work: dict) -> dict:
        from operators.inference import score_shard as run_shard

        return run_shard(work)

    @task(outlets=[CORPUS_SCORES_ASSET])
    def publish(shard_results: list) -> dict:
        from operators.inference import publish

        return publish(list(shard_results))

    publish(score_shard.expand(work=plan_shards()))  # type: ignore[arg-type]  # resolved at run time
