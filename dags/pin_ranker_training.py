"""Training DAG: plan → distributed training on the chosen backend → promotion gate → model registry."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from core import config
from operators.assets import CHAMPION_MODEL_ASSET, EXAMPLES_ASSET
from operators.backends import BACKENDS
from operators.errors import retry_policy
from operators.training import DistributedTrainingOperator

# The form's defaults are the platform configuration's (config/platform.yaml, PINFLOW_TRAINING__*).
_training = config.load().training

with DAG(
    dag_id="pin_ranker_training",
    doc_md="""
### Pin ranker training

Runs when a new day of `examples` lands, or from the trigger form. Trains the TransAct-style ranker
(transformer over the user's action sequence, sharded-id embedding tables, dense features, one head per
label: click, repin, hide) with `torchrun` on the chosen backend, evaluates it on the evaluation day
(AUC per head next to a popularity baseline), logs everything to MLflow and registers the model. The
promotion gate gives the new version the `champion` alias only if it is at least as good as the current
champion on the same day; a promotion emits `pinflow_champion_model`, which starts corpus inference.

The `backend` param picks where the job runs: `local`, `batch` (AWS Batch multi-node parallel job, the
team's fair share) or `kubernetes` (Kubeflow PyTorchJob in the team's Kueue queue). The task defers to
the triggerer while the job runs; a restarted or retried task reattaches to its running job instead of
submitting another. Infrastructure failures (lost node, Spot reclaim, stall) are retried and resume from
the last checkpoint; a bug, a NaN loss, missing data or OOM fail at once with the reason. The task's
extra links open the job's console page and the MLflow run.
""",
    schedule=[EXAMPLES_ASSET],
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["pinflow", "training"],
    default_args={
        "owner": "ml-eng",
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": 2.0,
        "retry_policy": retry_policy(),
    },
    params={
        "backend": Param(_training.backend, enum=list(BACKENDS), description="Where the job runs: local (torchrun on this machine), batch (AWS Batch multi-node job) or kubernetes (Kubeflow PyTorchJob)."),
        "end_ds": Param(None, type=["null", "string"], format="date", description="Evaluation day (default: newest examples day)."),
        "train_days": Param(_training.train_days, type="integer", minimum=1, maximum=30, description="Days of examples before the evaluation day to train on."),
        "epochs": Param(_training.epochs, type="integer", minimum=1, maximum=100, description="Passes over the training days."),
        "lr": Param(_training.lr, type="number", exclusiveMinimum=0, maximum=1, description="Peak learning rate (AdamW, warmup then cosine)."),
        "batch_size": Param(_training.batch_size, type="integer", minimum=8, maximum=65536, description="Examples per rank per step."),
        "strategy": Param(_training.strategy, enum=["ddp", "fsdp"], description="ddp: replicated model; fsdp: FSDP2, embedding tables sharded across ranks."),
        "nodes": Param(_training.nodes, type="integer", minimum=1, maximum=64, description="Nodes (local: agents on this machine)."),
        "procs_per_node": Param(_training.procs_per_node, type="integer", minimum=1, maximum=8, description="Worker processes per node."),
        "promotion_tolerance": Param(_training.promotion_tolerance, type="number", minimum=0, maximum=0.1, description="How much worse than the champion's mean AUC a new model may be and still be promoted."),
    },
    render_template_as_native_obj=True,
) as dag:

    @task(retries=0)
    def plan_run(params: dict | None = None) -> dict:
        from operators.training import plan_training_days

        assert params is not None
        return plan_training_days(params["end_ds"], int(params["train_days"]))

    train = DistributedTrainingOperator(
        task_id="train",
        plan="{{ ti.xcom_pull(task_ids='plan_run') }}",
        backend="{{ params.backend }}",
        nodes="{{ params.nodes }}",
        procs_per_node="{{ params.procs_per_node }}",
        overrides={"epochs": "{{ params.epochs }}", "lr": "{{ params.lr }}", "batch_size": "{{ params.batch_size }}",
                   "strategy": "{{ params.strategy }}"},
        execution_timeout=timedelta(hours=12),
        deferrable=True,
    )

    @task(outlets=[CHAMPION_MODEL_ASSET])
    def promote(result: dict, params: dict | None = None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from operators.training import promote_if_better

        assert params is not None
        decision = promote_if_better(result, float(params["promotion_tolerance"]))
        if not decision["promoted"]:
            # Skipped: no champion asset event, so corpus inference does not rerun for a worse model.
            raise AirflowSkipException(f"not promoted: {decision['reason']}")
        return decision

    plan_run() >> train
    promote(train.output)  # type: ignore[arg-type]  # XComArg resolves to the dict at run time
