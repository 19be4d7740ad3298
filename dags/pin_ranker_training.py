"""Training DAG for any model family: plan → distributed training on the chosen backend → promotion gate."""

from __future__ import annotations

from datetime import timedelta

# The Airflow modules the operators below import, named so that the DAG processor imports them once, before
# it forks the parses (parsing_pre_import_modules), instead of in every parse (docs/architecture.md).
import airflow.providers.standard.operators.hitl  # noqa: F401
import airflow.sdk.bases.operatorlink  # noqa: F401
import airflow.sdk.definitions.retry_policy  # noqa: F401
import pendulum
from airflow.sdk import Param

from core import config_view
from operators import deadlines
from operators.approval import ChampionApprovalOperator, ChampionPromoteOperator
from operators.assets import CHAMPION_MODEL_ASSET, EXAMPLES_ASSET
from operators.backends import backend_names
from operators.errors import default_args
from operators.params import team_param
from operators.training import DistributedTrainingOperator, TrainingPlanOperator

# The form's defaults are the platform configuration's (config/platform.yaml, PINFLOW_TRAINING__*); epochs,
# batch size and lr left empty take the chosen family's defaults (families:), else the training: section's.
_cfg = config_view.load()
_training = _cfg.training


def _family_default(key: str) -> str:
    values = {name: getattr(family, key) or getattr(_training, key) for name, family in _cfg.families.items()}
    return ", ".join(f"{name} {value}" for name, value in values.items())


with deadlines.DAG(  # Airflow's DAG; its test() runs without the deadline alerts (operators/deadlines.py)
    dag_id="pin_ranker_training",
    doc_md="""
### Model training

Trains the model family chosen by the `model` param (a model family is one file on the platform's model
SDK, `training/sdk.py`): `pin_ranker`, the TransAct-style ranker (transformer over the user's action sequence,
hashed-id embedding tables, dense features; heads click, repin, hide) on the `examples` of the days before the
evaluation day, or `pin_content`, the content-understanding model (safety and topic of a pin from its image
embedding, text and category) on the daily human reviews `raw/pin_labels`. Runs when a new day of `examples`
lands (training the `training.model` family, the ranker by default), or from the trigger form.

It trains with `torchrun` on the chosen backend, evaluates on the evaluation day (the family's metrics next
to a baseline and the synthetic world's oracle), logs to MLflow (the family's experiment, tags for DAG, run,
try, backend, job, team and family) and registers the family's model. The job also evaluates the family's
current champion on the same day. The promotion gate gives the new version the `champion` alias only if it
trained at least `training.min_steps` steps on the days asked for, every head's AUC clears chance and the
baseline (`promotion:` floors, the first model of a family too), and its mean AUC is at least the champion's on
that day (within `promotion_tolerance`); the decision and the numbers it compared are in the promote task's log
and XCom, the run's note and on the MLflow version. A promotion emits `pinflow_champion_model`, which starts
corpus inference of that family; a model that is not promoted emits nothing (the promote task is skipped).
For a family with `promotion: approval` in its configuration, a model that passes the gate also waits (the
`approve` task, up to `approval_timeout_h`) for a person to approve it on the run's *Required Actions* page, which
shows each head's AUC against the champion and the baseline; the reviewer is recorded as the one who moved the
alias. Reject, or no answer in time, leaves the champion as it is.

The `backend` param picks where the job runs: `local`, `batch` (AWS Batch multi-node parallel job, the
team's fair share) or `kubernetes` (a Kubeflow Trainer TrainJob, or a PyTorchJob, in the team's Kueue queue). The `team` param picks whose
quota, Airflow pool (`team-<name>`), queue and default instance type the job uses: while the team's jobs hold its
whole quota (jobs, nodes or GPUs), the task waits deferred, logging who holds it, and submits when there is room.
The run's *Training progress* tab (and *Pinflow → Training runs*) shows the job live: step of total, %,
examples/s, ETA, loss curve, each rank's heartbeat, the last checkpoint, the MLflow run and the promotion. The task defers to
the triggerer while the job runs; a restarted or retried task reattaches to its running job instead of
submitting another. Infrastructure failures (lost node, Spot reclaim, stall) are retried and resume from
the last checkpoint; a bug, a NaN loss, missing data or OOM fail at once with the reason. The task's
extra links open the job's console page and the MLflow run.
""",
    schedule=[EXAMPLES_ASSET],
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    # Teams and families share this DAG: runs go on at once and the team quotas (each team's pool, and the quota
    # admission before a job is submitted) decide which jobs run and which wait. One active run made a team's
    # second run queue behind any other team's.
    max_active_runs=8,
    deadline=deadlines.alerts(_cfg, "pin_ranker_training"),
    tags=["pinflow", "training"],
    default_args=default_args("ml-eng"),
    params={
        "model": Param(_training.model, enum=sorted(_cfg.families), description="The model family to train (families: in the platform configuration)."),
        "team": team_param(_cfg),
        "backend": Param(_training.backend, enum=list(backend_names()), description="Where the job runs: local (torchrun on this machine), batch (AWS Batch multi-node job) or kubernetes (Kubeflow TrainJob, or PyTorchJob per kubernetes.api)."),
        "end_ds": Param(None, type=["null", "string"], format="date", description="Evaluation day (default: newest examples day)."),
        "train_days": Param(_training.train_days, type="integer", minimum=1, maximum=30, description="Days of the family's data before the evaluation day to train on; fewer complete days fail the run unless accept_fewer_days."),
        "accept_fewer_days": Param(False, type="boolean", description="Train on the complete days there are when fewer than train_days exist (the model is registered, not promoted)."),
        "epochs": Param(None, type=["null", "integer"], minimum=1, maximum=100, description=f"Passes over the training days (empty: {_family_default('epochs')})."),
        "max_steps": Param(_training.max_steps or None, type=["null", "integer"], minimum=1, description="Training length: a cap on optimizer steps over the epochs or target_examples (empty: no cap). The run's summary warns when it trained fewer steps than its warmup or than training.min_steps."),
        "target_examples": Param(_training.target_examples or None, type=["null", "integer"], minimum=1, description="Training length as examples seen (all ranks), instead of epochs: as many passes as that takes, up to 100 (empty: by epochs)."),
        "lr": Param(None, type=["null", "number"], exclusiveMinimum=0, maximum=1, description=f"Peak learning rate, AdamW with warmup then cosine (empty: {_family_default('lr')})."),
        "batch_size": Param(None, type=["null", "integer"], minimum=8, maximum=65536, description=f"Examples per rank per step (empty: {_family_default('batch_size')})."),
        "strategy": Param(_training.strategy, enum=["ddp", "torchrec", "fsdp"], description="ddp: replicated model; torchrec: embedding tables sharded model-parallel by TorchRec, the rest under DDP; fsdp: FSDP2 per table (a fallback)."),
        "sharding": Param(_training.sharding, enum=["row_wise", "table_wise", "column_wise"], description="With strategy torchrec: how the tables are split over the ranks (row_wise: a table larger than one rank's memory trains)."),
        "nodes": Param(_training.nodes, type="integer", minimum=1, maximum=64, description="Nodes (local: agents on this machine)."),
        "procs_per_node": Param(_training.procs_per_node, type="integer", minimum=1, maximum=8, description="Worker processes per node."),
        "input_engine": Param(_training.input_engine, enum=["local", "ray"], description="local: each training process reads its input with its own worker processes; ray: a Ray Data pipeline on the cluster's CPU workers builds the batches (the same batches)."),
        "num_workers": Param(_training.num_workers, type=["null", "integer"], minimum=0, maximum=64, description="Input worker processes per training process (input_engine local; empty: derived from the node's CPUs)."),
        "num_threads": Param(_training.num_threads, type=["null", "integer"], minimum=1, maximum=256, description="Torch threads per training process (empty: derived from the node's CPUs)."),
        "prefetch_factor": Param(_training.prefetch_factor, type="integer", minimum=1, maximum=64, description="Items (of 8192 rows) each input worker prepares ahead."),
        "pin_memory": Param(_training.pin_memory, type=["null", "boolean"], description="Page-locked batches for faster copies to the GPU (empty: on CUDA)."),
        "promotion_tolerance": Param(_training.promotion_tolerance, type="number", minimum=0, maximum=0.1, description="How much worse than the champion's mean AUC a new model may be and still be promoted."),
        "approval_timeout_h": Param(None, type=["null", "number"], exclusiveMinimum=0, maximum=720, description=f"For a family with promotion: approval, hours to wait for a person's answer on the Required Actions page; no answer leaves the champion as it is (empty: {_cfg.promotion.approval_timeout_h})."),
    },
    render_template_as_native_obj=True,
) as dag:

    train = DistributedTrainingOperator(
        task_id="train",
        plan="{{ ti.xcom_pull(task_ids='plan_run') }}",
        model="{{ params.model }}",
        backend="{{ params.backend }}",
        team="{{ params.team }}",
        nodes="{{ params.nodes }}",
        procs_per_node="{{ params.procs_per_node }}",
        overrides={"epochs": "{{ params.epochs }}", "lr": "{{ params.lr }}", "batch_size": "{{ params.batch_size }}",
                   "strategy": "{{ params.strategy }}", "sharding": "{{ params.sharding }}", "max_steps": "{{ params.max_steps }}",
                   "target_examples": "{{ params.target_examples }}", "num_workers": "{{ params.num_workers }}",
                   "num_threads": "{{ params.num_threads }}", "prefetch_factor": "{{ params.prefetch_factor }}",
                   "pin_memory": "{{ params.pin_memory }}", "input_engine": "{{ params.input_engine }}"},
        execution_timeout=timedelta(hours=12),
        deferrable=True,
    )

    # A family with promotion: approval waits here for a person's answer (the Required Actions page); else it
    # returns at once.
    approve = ChampionApprovalOperator(
        task_id="approve",
        result="{{ ti.xcom_pull(task_ids='train') }}",
        tolerance="{{ params.promotion_tolerance }}",
        timeout_h="{{ params.approval_timeout_h }}",
    )

    promote = ChampionPromoteOperator(task_id="promote", result=train.output, approval=approve.output,
                                      outlets=[CHAMPION_MODEL_ASSET])

    TrainingPlanOperator(task_id="plan_run", retries=0) >> train >> approve >> promote
