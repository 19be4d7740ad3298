"""Hyperparameter search for any model family: an Optuna study whose trials are training jobs, in rounds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

# The Airflow modules the operators below import, named so that the DAG processor imports them once, before
# it forks the parses (parsing_pre_import_modules), instead of in every parse (docs/architecture.md).
import airflow.providers.standard.operators.empty  # noqa: F401
import airflow.sdk.bases.operatorlink  # noqa: F401
import airflow.sdk.bases.sensor  # noqa: F401
import airflow.sdk.definitions.retry_policy  # noqa: F401
import pendulum
from airflow.sdk import DAG, Param, TaskGroup

from core import config_view
from operators.assets import CHAMPION_MODEL_ASSET
from operators.backends import backend_names
from operators.errors import default_args
from operators.hpo_trial import (
    HpoTrialOperator,
    StudyAskOperator,
    StudyCreateOperator,
    StudyPromoteOperator,
    StudySummaryOperator,
    StudyTellOperator,
)

_cfg = config_view.load()
_training, _hpo = _cfg.training, _cfg.hpo

EXAMPLE_SPACE = {
    "lr": {"type": "float", "low": 0.0005, "high": 0.05, "log": True},
}

with DAG(
    dag_id="pinflow_hpo",
    doc_md=f"""
### Hyperparameter search

An [Optuna](https://optuna.org) study over the hyperparameters of one model family (param `model`), whose
trials are the platform's training jobs: each trial is a `DistributedTrainingOperator` job on the chosen
`backend` for the chosen `team` (quota, job history, Airflow retries and exact resume from its checkpoint, like
any training run), trained on the same days and evaluated on the same day, so trials compare like with like.

**Rounds.** `create_study` checks the form and creates the study (or continues it: one study per DAG run, in
the study storage, `hpo.storage_url`: SQLite under `PINFLOW_HOME` here). Then, up to `hpo.max_rounds`
({_hpo.max_rounds}) times: `round_N.ask` asks up to `parallel_trials` trials (TPE sampler with `constant_liar`, so
the trials of a round spread out; the first is the family's defaults, the *baseline*, unless `baseline` is
off) → `round_N.trial` trains them at once (one mapped task each) → `round_N.tell` tells the study how each ended.
The study stops when `n_trials` have run or its rounds have taken `time_budget_minutes` (a round that has
started finishes); later rounds are skipped.

**Pruning.** While a trial trains, its task's trigger reports the trial's `{_hpo.prune_metric}` (logged to its
MLflow run every {_hpo.report_every_steps} steps) to the study, and the median pruner stops a trial whose best
value is worse than the median of the completed trials at the same step: its job is cancelled and the trial is
recorded as *pruned*; the task succeeds.

**Search space** (param `search_space`): a JSON object, one entry per parameter, a field of the family's
`Params` or one of the run's `lr`, `batch_size`, `epochs`, `weight_decay`, `warmup_steps`, `min_lr_ratio`,
`grad_clip`: `{{"type": "float", "low": 0.001, "high": 0.1, "log": true}}`, `{{"type": "int", "low": 16,
"high": 128, "step": 16}}`, `{{"type": "categorical", "choices": [32, 64]}}`. A bad entry fails
`create_study` at once, naming it. `fixed` sets RUN.json fields of every trial (`{{"epochs": 3, "params":
{{"width": 32}}}}`); `enqueue` lists trials to run first.

**At the end** `promote` registers the best trial's model (trials do not register theirs) and puts it through
the training DAG's promotion gate (a promotion starts corpus inference); `summary` returns the study's summary
in its XCom: best trial and params, the gain over the baseline, trials completed / pruned / failed, parameter
importance and the promotion decision; when the run ends the same summary becomes the run's note (a listener:
`operators/run_notes.py`). MLflow has a parent run for the study (family's experiment) with a child run per
trial.

**Re-running** the DAG run (clear it) continues the same study: trials that ended are kept and not trained
again, a trial that was running resumes from its checkpoint, no trial is asked twice.
""",
    schedule=None,
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=2,
    tags=["pinflow", "training", "hpo"],
    default_args=default_args("ml-eng"),
    params={
        "model": Param(_training.model, enum=sorted(_cfg.families), description="The model family to tune (families: in the platform configuration)."),
        "search_space": Param(EXAMPLE_SPACE, type="object", description='One entry per searched parameter (the family\'s params, or lr, batch_size, epochs, weight_decay, warmup_steps, min_lr_ratio, grad_clip): {"type": "float", "low": ..., "high": ..., "log": true}, {"type": "int", "low": ..., "high": ..., "step": ...} or {"type": "categorical", "choices": [...]}.'),
        "n_trials": Param(_hpo.n_trials, type="integer", minimum=1, maximum=1000, description=f"Trials in the study (at most hpo.max_rounds = {_hpo.max_rounds} rounds of parallel_trials)."),
        "parallel_trials": Param(_hpo.parallel_trials, type="integer", minimum=1, maximum=64, description="Trials trained at once (one round)."),
        "metric": Param(_hpo.metric, type="string", description="The evaluation metric to optimise, a key of the family's evaluation (mean_auc, auc_safety, topic_accuracy, ...)."),
        "direction": Param(_hpo.direction, enum=["maximize", "minimize"], description="Of the metric."),
        "time_budget_minutes": Param(_hpo.time_budget_minutes, type="number", minimum=0, description="No new round starts once the rounds have taken this long; 0: no limit."),
        "team": Param(_training.team, enum=sorted(_cfg.teams), description="The team whose queue, fair share and quota the trials use."),
        "backend": Param(_training.backend, enum=list(backend_names()), description="Where the trials run: local, batch or kubernetes."),
        "end_ds": Param(None, type=["null", "string"], format="date", description="Evaluation day of every trial (default: the newest complete day)."),
        "train_days": Param(_hpo.train_days, type="integer", minimum=1, maximum=30, description="Days before the evaluation day every trial trains on."),
        "fixed": Param({}, type="object", description='RUN.json fields every trial gets, e.g. {"epochs": 3, "max_steps": 500, "params": {"width": 32}}.'),
        "enqueue": Param([], type="array", description='Trials to run first (after the baseline): a list of objects of searched values, e.g. [{"lr": 0.01}].'),
        "baseline": Param(True, type="boolean", description="Run the family's defaults as the first trial, to measure the gain against."),
        "seed": Param(0, type="integer", description="Seed of the sampler."),
        "nodes": Param(_training.nodes, type="integer", minimum=1, maximum=64, description="Nodes of each trial's job."),
        "procs_per_node": Param(_training.procs_per_node, type="integer", minimum=1, maximum=8, description="Worker processes per node of each trial."),
        "promote": Param(True, type="boolean", description="Put the best trial's model through the promotion gate."),
        "promotion_tolerance": Param(_training.promotion_tolerance, type="number", minimum=0, maximum=0.1, description="How much worse than the champion's mean AUC the best trial's model may be and still be promoted."),
    },
    render_template_as_native_obj=True,
) as dag:

    study = StudyCreateOperator(task_id="create_study")
    told = []
    previous: Any = study
    for r in range(_hpo.max_rounds):
        with TaskGroup(group_id=f"round_{r}"):
            asked = StudyAskOperator(task_id="ask", round_index=r)
            trials = HpoTrialOperator.partial(
                task_id="trial",
                model="{{ params.model }}",
                backend="{{ params.backend }}",
                team="{{ params.team }}",
                nodes="{{ params.nodes }}",
                procs_per_node="{{ params.procs_per_node }}",
                execution_timeout=timedelta(hours=12),
            ).expand(trial=asked.output)
            round_told = StudyTellOperator(task_id="tell", round_index=r, ask_task_id=asked.task_id)
            trials >> round_told
        previous >> asked
        previous = round_told
        told.append(round_told)

    promoted = StudyPromoteOperator(task_id="promote", study=study.output, outlets=[CHAMPION_MODEL_ASSET],
                                    trigger_rule="none_failed_min_one_success")
    told >> promoted  # type: ignore[operator]
    promoted >> StudySummaryOperator(task_id="summary", study=study.output, trigger_rule="none_failed")
