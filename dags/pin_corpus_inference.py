"""Corpus inference DAG: plan the shards from the work → score the missing ones as one job (deferred) → publish."""

from __future__ import annotations

from typing import Any

# The Airflow modules the operators below import, named so that the DAG processor imports them once, before
# it forks the parses (parsing_pre_import_modules), instead of in every parse (docs/architecture.md).
import airflow.sdk.definitions.retry_policy  # noqa: F401
import pendulum
from airflow.sdk import DAG, Param, task

from core import config_view
from operators.assets import CHAMPION_MODEL_ASSET, CORPUS_SCORES_ASSET
from operators.backends import backend_names
from operators.errors import default_args
from operators.inference import ENGINES, CorpusScoringOperator

_cfg = config_view.load()

with DAG(
    dag_id="pin_corpus_inference",
    doc_md="""
### Pin corpus inference

Scores the whole pin corpus with a model of any family that scores it (`model`: `pin_content` writes each
pin's `p_unsafe`, topic distribution and content embedding; `pin_ranker` each pin's prior engagement
probabilities in a non-personalised context). Runs when a family's model version is promoted to `champion`
(the promotion's asset event names the family and version), or from the trigger form for any family and
version.

1. `plan_shards`: cuts the corpus snapshot into shards sized by the work (its pins, the throughput earlier runs
   of the model measured, `inference.target_shard_seconds` per shard, capped), or into `shards` if set. The
   plan (model version, snapshot fingerprint, shard count, batch size) keys the output: parts of another plan
   are never reused.
2. `score_shards`: one job for the shards without a part: an array job of scoring processes (local parallel
   processes, an AWS Batch array job, a Kubernetes Indexed Job) or, with `engine: ray`, a Ray Data job; the task
   waits in the triggerer. A killed process is INFRA: the retry scores only the shards still missing.
3. `publish`: checks every pin of the snapshot is in exactly one part (counts and pin-id checksums), then
   `inference/<model>/<version>/ds=<day>/part-NNNNN.parquet` with `_MANIFEST.json` written last: readers use
   only manifested outputs.
""",
    schedule=[CHAMPION_MODEL_ASSET],
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["pinflow", "inference"],
    default_args=default_args("ml-eng"),
    params={
        "model": Param(_cfg.training.model, enum=sorted(_cfg.families), description="The model family whose model scores the corpus."),
        "model_version": Param("champion", type="string", description="A version number, or the alias 'champion'."),
        "ds": Param(None, type=["null", "string"], format="date", description="Pin corpus snapshot day (default: newest)."),
        "shards": Param(_cfg.inference.shards, type=["null", "integer"], minimum=1, maximum=10000,
                        description="Shards of the corpus; empty: sized by the work (pins, measured throughput, inference.target_shard_seconds)."),
        "engine": Param(_cfg.inference.engine, enum=list(ENGINES),
                        description="processes: one scoring process per shard (an array job); ray: one Ray Data job."),
        "backend": Param(_cfg.training.backend, enum=list(backend_names()), description="Where the scoring job runs."),
    },
    render_template_as_native_obj=True,
) as dag:

    @task(retries=0)
    def plan_shards(params: dict | None = None, triggering_asset_events: Any = None, dag_run: Any = None,
                    dag: Any = None) -> dict:
        from operators.inference import plan_inference
        from operators.run_conf import check_run_conf

        assert params is not None
        check_run_conf({"dag_run": dag_run, "params": params, "dag": dag})
        model, version = str(params["model"]), str(params["model_version"])
        events = [event for events in (triggering_asset_events or {}).values() for event in events]
        if events:  # started by a promotion: score with the champion it made, of its family
            extra = events[-1].extra or {}
            model, version = str(extra.get("model", model)), str(extra.get("model_version", version))
        shards = int(params["shards"]) if params.get("shards") else None
        return plan_inference(model, version, params["ds"], shards, engine=params.get("engine"),
                              backend=params.get("backend"))

    @task(outlets=[CORPUS_SCORES_ASSET])
    def publish(plan: dict) -> dict:
        from operators.inference import publish

        return publish(plan)

    plan = plan_shards()
    score = CorpusScoringOperator(task_id="score_shards", plan=plan)
    score >> publish(plan)  # type: ignore[arg-type]  # resolved at run time
