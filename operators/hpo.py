"""Hyperparameter search: an Optuna study whose trials are the platform's training jobs.

One study per DAG run of ``pinflow_hpo`` (named after the DAG and run ids), on an RDB storage: SQLite under
``PINFLOW_HOME`` on the embedded default, ``hpo.storage_url`` (PostgreSQL) in production. Everything about
the study lives in that storage, so any task can be re-run and a re-run of the DAG run continues the study:

- :func:`create_study` validates the form (the search space above all: a bad entry is a USER error naming it),
  plans the training days, creates the study once (its definition in the study's user attributes), queues the
  baseline (the family's defaults) and any trials given to run first, and starts the MLflow parent run;
- :func:`ask_round` asks up to ``parallel`` trials (TPE, ``constant_liar`` so trials of one round spread out),
  each tagged with its round: a re-run of the round returns the same trials;
- :class:`~operators.hpo_trial.HpoTrialOperator` trains one trial as a
  :class:`~operators.training.DistributedTrainingOperator` job (retries, exact resume, quotas and job history like
  any run); its trigger (:class:`~operators.hpo_trigger.HpoTrialTrigger`)
  reports the trial's per-step ``hpo.prune_metric`` from its MLflow run to the study as intermediate values and,
  when the pruner says so, cancels the job: the task ends with the trial recorded as pruned, not failed;
- :func:`tell_round` tells the study how each trial of the round ended (complete with its metric, pruned,
  or failed with the reason);
- :func:`promote_best` registers the best trial's model and puts it through the training DAG's promotion gate;
  :func:`summarize` returns the study's summary (best params, trials by state, parameter importance).

A trial that has ended (complete, pruned or failed) is never trained again; one that was running when the DAG
run stopped resumes from its checkpoint when the run is cleared.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from core.failures import PinflowError, UserError, as_typed
from operators.hpo_space import StudySpec, build_spec

if TYPE_CHECKING:
    import optuna

    from core.config import PlatformConfig

log = logging.getLogger(__name__)

PRUNED = "PRUNED"
# Study and trial user attributes (the study's state lives in its storage).
SPEC_ATTR = "pinflow.spec"
ROUNDS_ATTR = "pinflow.rounds"
ENQUEUED_ATTR = "pinflow.enqueued"
STOPPED_ATTR = "pinflow.stopped"
PARENT_RUN_ATTR = "pinflow.mlflow_parent_run_id"
PROMOTION_ATTR = "pinflow.promotion"
ROUND_ATTR = "pinflow.round"
SLOT_ATTR = "pinflow.slot"
RESULT_ATTR = "pinflow.result"
ERROR_ATTR = "pinflow.error"
BASELINE_ATTR = "baseline"  # set by enqueue_trial's user_attrs on the baseline trial


# -- the storage ---------------------------------------------------------------------------------------------
def storage_url(cfg: PlatformConfig) -> str:
    return cfg.hpo.storage_url or f"sqlite:///{cfg.home}/hpo/optuna.db"


def redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only for a log line
        return "(unparsable storage URL)"


def open_storage(cfg: PlatformConfig | None = None) -> Any:
    """The study storage (``hpo.storage_url``; SQLite under PINFLOW_HOME on the embedded default), one per process."""
    from core import config
    return _storage(storage_url(cfg or config.load()))


@functools.cache
def _storage(url: str) -> Any:
    from pathlib import Path

    import optuna

    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # Tasks and triggers write to one file: wait for the lock rather than fail at once.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except Exception as err:
        raise as_typed(err, f"the Optuna study storage {redacted(url)} (hpo.storage_url)") from err


def study_name(dag_id: str, run_id: str) -> str:
    return f"{dag_id}/{run_id}"


def _study_attrs(storage: Any, name: str) -> dict[str, Any] | None:
    import optuna

    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    except optuna.exceptions.OptunaError:
        return None
    return dict(storage.get_study_user_attrs(study_id))


def sampler_for(spec: StudySpec, trials_so_far: int) -> Any:
    """TPE with ``constant_liar`` (the trials of a round are asked together); its seed moves with the study, so
    each round's sampler (made anew in each task) does not repeat the last one's draws."""
    import numpy as np
    import optuna

    # Mixed, not seed + n: the first draws of generators seeded 1, 2, 3 lie close together.
    seed = int(np.random.SeedSequence([spec.seed, trials_so_far]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.tpe_startup_trials,
                                      constant_liar=True, multivariate=True)


def pruner_for(spec: StudySpec) -> Any:
    import optuna

    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=spec.prune_startup_trials,
                                       n_warmup_steps=spec.prune_warmup_steps, interval_steps=1)


def load(name: str, storage: Any | None = None) -> tuple[optuna.Study, StudySpec]:
    """The study ``name`` with its sampler and pruner, and its definition."""
    import optuna

    storage = storage or open_storage()
    attrs = _study_attrs(storage, name)
    if attrs is None or SPEC_ATTR not in attrs:
        raise UserError(f"Optuna study {name!r} does not exist in the study storage: its create_study task must run first")
    spec = StudySpec.from_json(attrs[SPEC_ATTR])
    count = storage.get_n_trials(storage.get_study_id_from_name(name))
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler_for(spec, count),
                             pruner=pruner_for(spec)), spec


def _trials(study: optuna.Study, round_index: int | None = None) -> list[optuna.trial.FrozenTrial]:
    trials = [t for t in study.get_trials(deepcopy=False) if ROUND_ATTR in t.user_attrs]
    if round_index is not None:
        trials = [t for t in trials if t.user_attrs[ROUND_ATTR] == round_index]
    return sorted(trials, key=lambda t: (t.user_attrs[ROUND_ATTR], t.user_attrs.get(SLOT_ATTR, 0), t.number))


# -- the tasks -----------------------------------------------------------------------------------------------
def create_study(dag_id: str, run_id: str, form: dict[str, Any], *, team: str = "") -> dict[str, Any]:
    """Create the study of this DAG run, or continue it: its definition is the first run's."""
    import optuna

    from core import config
    from operators.training import plan_training_days

    cfg = config.load()
    storage = open_storage(cfg)
    name = study_name(dag_id, run_id)
    attrs = _study_attrs(storage, name) or {}
    if SPEC_ATTR in attrs:
        spec = StudySpec.from_json(attrs[SPEC_ATTR])
        log.info("continuing Optuna study %r in %s: %d trial(s) so far", name, redacted(storage_url(cfg)),
                 storage.get_n_trials(storage.get_study_id_from_name(name)))
    else:
        spec = build_spec(form, cfg)  # the form first: a bad search space fails before anything is created
        plan = plan_training_days(spec.family, form.get("end_ds"), int(form.get("train_days") or cfg.hpo.train_days))
        spec = dataclasses.replace(spec, plan=plan)
        study = optuna.create_study(study_name=name, storage=storage, direction=spec.direction,  # type: ignore[arg-type]
                                    load_if_exists=True)
        study.set_user_attr(SPEC_ATTR, spec.to_json())
        log.info("created Optuna study %r in %s: %s %s of %s over %s", name, redacted(storage_url(cfg)),
                 spec.direction, spec.metric, spec.family, json.dumps(spec.space))
    study, spec = load(name, storage)
    if not study.user_attrs.get(ENQUEUED_ATTR):  # skip_if_exists: a re-run after a crash queues nothing twice
        if spec.baseline is not None:
            study.enqueue_trial(spec.baseline, user_attrs={BASELINE_ATTR: True}, skip_if_exists=True)
        for values in spec.enqueue:
            study.enqueue_trial(values, skip_if_exists=True)
        study.set_user_attr(ENQUEUED_ATTR, True)
    parent = _parent_run(study, spec, cfg, dag_id=dag_id, run_id=run_id, team=team)
    return {"study": name, "family": spec.family, "metric": spec.metric, "direction": spec.direction,
            "n_trials": spec.n_trials, "parallel_trials": spec.parallel, "plan": spec.plan, "mlflow_parent_run_id": parent}


def mlflow_client(cfg: PlatformConfig) -> Any:
    from services import model_registry as registry

    return registry.client(cfg.mlflow)


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifact_location or None))
    except Exception:  # noqa: BLE001 - created meanwhile by a job: read it again
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def _parent_run(study: optuna.Study, spec: StudySpec, cfg: PlatformConfig, *, dag_id: str, run_id: str, team: str) -> str:
    """The study's MLflow parent run in the family's experiment, made once (this also creates MLflow's schema and
    the experiment before the trials fan out: two jobs creating them at once on an empty database collide)."""
    existing = study.user_attrs.get(PARENT_RUN_ATTR)
    if existing:
        return str(existing)
    try:
        client = mlflow_client(cfg)
        fam = cfg.families[spec.family]
        experiment = _experiment_id(client, fam.experiment or spec.family, cfg.mlflow.artifact_root)
        run = client.create_run(experiment, run_name=f"hpo-{run_id}", tags={
            "pinflow.dag": dag_id, "pinflow.run": run_id, "pinflow.family": spec.family, "pinflow.team": team,
            "pinflow.hpo.study": study.study_name, "pinflow.hpo.role": "study",
            "mlflow.note.content": f"Optuna study {study.study_name}: {spec.direction} {spec.metric} over "
                                   f"{', '.join(spec.space)}; {spec.n_trials} trials, {spec.parallel} at a time",
        })
        from mlflow.entities import Param

        params = {"metric": spec.metric, "direction": spec.direction, "n_trials": spec.n_trials,
                  "parallel_trials": spec.parallel, "time_budget_s": spec.time_budget_s, "sampler": "TPE(constant_liar)",
                  "pruner": spec.pruner, "prune_metric": spec.prune_metric, "seed": spec.seed,
                  "search_space": json.dumps(spec.space), "fixed": json.dumps(spec.fixed),
                  "eval_ds": spec.plan.get("eval_ds"), "train_days": json.dumps(spec.plan.get("train_days"))}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    except Exception as err:
        raise as_typed(err, f"the MLflow parent run of study {study.study_name}") from err
    study.set_user_attr(PARENT_RUN_ATTR, run.info.run_id)
    return str(run.info.run_id)


def _rounds(study: optuna.Study) -> dict[str, dict[str, float]]:
    return dict(study.user_attrs.get(ROUNDS_ATTR) or {})


def _set_round(study: optuna.Study, round_index: int, **times: float) -> None:
    rounds = _rounds(study)
    rounds[str(round_index)] = {**rounds.get(str(round_index), {}), **times}
    study.set_user_attr(ROUNDS_ATTR, rounds)


def _spent(study: optuna.Study) -> float:
    """Seconds the study's finished rounds took (the time budget counts these, not time the run stood still)."""
    return sum(max(0.0, r["told_at"] - r["asked_at"]) for r in _rounds(study).values() if "told_at" in r and "asked_at" in r)


def ask_round(name: str, round_index: int) -> list[dict[str, Any]]:
    """The trials of round ``round_index``: those already asked for it (a re-run), else up to ``parallel`` new ones.

    Once the study has all its trials or its time budget is spent, records why and skips (so do later rounds).
    """
    from airflow.sdk.exceptions import AirflowSkipException
    from optuna.trial import TrialState

    study, spec = load(name)
    mine = _trials(study, round_index)
    earlier = [t for t in _trials(study) if t.user_attrs[ROUND_ATTR] < round_index]
    if not mine:
        stopped = study.user_attrs.get(STOPPED_ATTR)
        if stopped:
            raise AirflowSkipException(f"study {name} is done: {stopped}")
        reason = ""
        if len(earlier) >= spec.n_trials:
            reason = f"all {spec.n_trials} trials have run"
        elif spec.time_budget_s and _spent(study) >= spec.time_budget_s:
            reason = (f"its time budget of {spec.time_budget_s / 60:g} min is spent ({_spent(study) / 60:.1f} min in "
                      f"{len(_rounds(study))} round(s)); {len(earlier)} of {spec.n_trials} trials ran")
        if reason:
            study.set_user_attr(STOPPED_ATTR, reason)
            log.info("study %s: no round %d: %s", name, round_index, reason)
            raise AirflowSkipException(f"study {name} is done: {reason}")
    want = min(spec.parallel, spec.n_trials - len(earlier))
    if "asked_at" not in _rounds(study).get(str(round_index), {}):
        _set_round(study, round_index, asked_at=time.time())
    distributions = spec.distributions()
    # Asked by an earlier try that died before tagging them: this round's, not asked again.
    orphans = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if ROUND_ATTR not in t.user_attrs]
    for slot in range(len(mine), want):
        if orphans:
            orphan = orphans.pop(0)
            number, params = orphan.number, orphan.params
            trial_id = orphan._trial_id
        else:
            trial = study.ask(fixed_distributions=distributions)  # an enqueued trial (baseline) first
            number, params, trial_id = trial.number, trial.params, trial._trial_id
        study._storage.set_trial_user_attr(trial_id, ROUND_ATTR, round_index)
        study._storage.set_trial_user_attr(trial_id, SLOT_ATTR, slot)
        log.info("study %s round %d: trial %d %s", name, round_index, number, json.dumps(params))
    mine = _trials(study, round_index)
    return [trial_spec(name, spec, t) for t in mine]


def trial_spec(name: str, spec: StudySpec, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """What a trial's training task needs: its RUN.json fields and family params (fixed, then searched)."""
    entries = spec.entries()
    run = {k: v for k, v in spec.fixed.items() if k != "params"}
    params = dict(spec.fixed.get("params") or {})
    for key, value in trial.params.items():
        (params if entries[key].target == "params" else run)[key] = value
    return {"study": name, "number": trial.number, "round": trial.user_attrs[ROUND_ATTR], "params": dict(trial.params),
            "run": run, "family_params": params, "plan": spec.plan, "baseline": bool(trial.user_attrs.get(BASELINE_ATTR))}


def tell_round(name: str, round_index: int, ask_state: str | None = None) -> dict[str, Any]:
    """Tell the study how each trial of the round ended; a trial whose task failed is a failed trial.

    ``ask_state`` is the state of the round's ask task: skipped (the study is done) or upstream_failed (an earlier
    task failed, which fails the run already) skip this task too; failed fails it. Raises when every trial of the
    round failed (something is wrong with every trial, not with one point of the space).
    """
    from airflow.sdk.exceptions import AirflowSkipException
    from optuna.trial import TrialState

    if ask_state in ("skipped", "upstream_failed"):
        raise AirflowSkipException(f"round {round_index} asked no trials (its ask task is {ask_state})")
    if ask_state == "failed":
        raise UserError(f"round {round_index} of study {name}: its ask task failed (see its log); the study stops here")
    study, spec = load(name)
    mine = _trials(study, round_index)
    if not mine:
        stopped = study.user_attrs.get(STOPPED_ATTR)
        if stopped:
            raise AirflowSkipException(f"study {name} is done: {stopped}")
        raise UserError(f"round {round_index} of study {name} asked no trials: its ask task did not run (see it)")
    failures = []
    for trial in mine:
        result = trial.user_attrs.get(RESULT_ATTR) or {}
        if trial.state.is_finished():
            if trial.state == TrialState.FAIL:
                failures.append(f"trial {trial.number}: {trial.user_attrs.get(ERROR_ATTR, 'failed')}")
            continue
        if result.get("state") == "COMPLETE" and result.get("value") is not None and math.isfinite(result["value"]):
            study.tell(trial.number, float(result["value"]))
        elif result.get("state") == PRUNED:
            study.tell(trial.number, state=TrialState.PRUNED)
        else:
            reason = trial.user_attrs.get(ERROR_ATTR) or "its training task did not finish"
            if result.get("state") == "COMPLETE":
                reason = f"metric {spec.metric} is {result.get('value')!r}"
            study.tell(trial.number, state=TrialState.FAIL)
            failures.append(f"trial {trial.number}: {reason}")
    _set_round(study, round_index, told_at=time.time())
    summary = round_summary(study, spec, round_index)
    _log_parent(study, spec)
    log.info("study %s round %d: %s", name, round_index, json.dumps(summary["trials"]))
    if failures and len(failures) == len(mine):
        raise UserError(
            f"every trial of round {round_index} of study {name} failed, so the study stops: " + "; ".join(failures)
            + " — fix the cause (the trials' task logs say more), then clear the DAG run: finished trials are kept"
        )
    return summary


def _trial_row(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return {"number": trial.number, "state": trial.state.name, "value": trial.value, "params": trial.params,
            "baseline": bool(trial.user_attrs.get(BASELINE_ATTR))}


def round_summary(study: optuna.Study, spec: StudySpec, round_index: int) -> dict[str, Any]:
    best = _best(study)
    return {"study": study.study_name, "round": round_index, "trials": [_trial_row(t) for t in _trials(study, round_index)],
            "best": _trial_row(best) if best else None}


def _best(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:  # no trial completed yet
        return None


def _log_parent(study: optuna.Study, spec: StudySpec) -> None:
    """The parent run's view of the study: each trial's value and state counts, the best so far."""
    from optuna.trial import TrialState

    from core import config

    run_id = study.user_attrs.get(PARENT_RUN_ATTR)
    if not run_id:
        return
    try:
        from mlflow.entities import Metric

        client = mlflow_client(config.load())
        now = int(time.time() * 1000)
        trials = _trials(study)
        metrics = [Metric(f"trial_{spec.metric}", float(t.value), now, t.number)
                   for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        finished = sum(t.state.is_finished() for t in trials)
        for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            metrics.append(Metric(f"trials_{state.name.lower()}", float(sum(t.state == state for t in trials)), now, finished))
        best = _best(study)
        if best is not None and best.value is not None:
            metrics.append(Metric(f"best_{spec.metric}", float(best.value), now, finished))
            client.set_tag(run_id, "pinflow.hpo.best_trial", str(best.number))
            client.set_tag(run_id, "pinflow.hpo.best_params", json.dumps(best.params))
        client.log_batch(str(run_id), metrics=metrics)
    except Exception as err:  # noqa: BLE001 - the study is the record; its MLflow view must not fail a round
        log.warning("could not log study %s to its MLflow parent run %s: %s", study.study_name, run_id, err)


def promote_best(name: str, tolerance: float, promote: bool = True) -> dict[str, Any] | None:
    """Register the best trial's model and put it through the promotion gate (``promote_if_better``).

    Returns the decision (also kept in the study); None when promotion is switched off.
    """
    from services.promotion import promote_if_better

    study, spec = load(name)
    best = _best(study)
    if best is None:
        raise UserError(f"study {name} has no completed trial: nothing to promote ({_counts(study)})")
    if not promote:
        decision: dict[str, Any] = {"promoted": False, "reason": "promotion switched off (param promote)", "trial": best.number}
        study.set_user_attr(PROMOTION_ATTR, decision)
        return None
    cached = study.user_attrs.get(PROMOTION_ATTR)
    if cached and cached.get("trial") == best.number and cached.get("model_version"):
        log.info("best trial %d was put through the gate already: %s", best.number, cached.get("reason"))
        return dict(cached)
    result = dict(best.user_attrs[RESULT_ATTR])
    version = register_trial_model(spec, best.number, result)
    decision = promote_if_better({**result, "model_version": version}, tolerance,
                                 moved_by=f"HPO study {name} (best trial {best.number})")
    decision.update(trial=best.number, value=best.value, params=best.params)
    study.set_user_attr(PROMOTION_ATTR, decision)
    return decision


def register_trial_model(spec: StudySpec, number: int, result: dict[str, Any]) -> str:
    """The registered version of a trial's logged model (registered once: a re-run finds the version by run id)."""
    import mlflow

    from core import config

    cfg = config.load()
    client = mlflow_client(cfg)
    name = result["model_name"]
    run_id = result["mlflow_run_id"]
    try:
        found = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
        if found:
            return str(found[0].version)
        mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
        mlflow.set_registry_uri(cfg.mlflow.tracking_uri)
        from training.inference import SHARDED_ROWS_TAG

        rows = result.get("sharded_table_rows")  # a model exported sharded: what its corpus plan groups pins by
        version = mlflow.register_model(result["model_uri"], name, tags={
            "pinflow.hpo.study": str(result.get("study", "")), "pinflow.hpo.trial": str(number),
            f"pinflow.hpo.{spec.metric}": str(result.get("value")),
            **({SHARDED_ROWS_TAG: str(rows)} if rows else {}),
        })
        return str(version.version)
    except PinflowError:
        raise
    except Exception as err:
        raise as_typed(err, f"registering the model of trial {number} ({result.get('model_uri')})") from err


def _counts(study: optuna.Study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in _trials(study):
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    return counts


def importance(study: optuna.Study) -> dict[str, float] | None:
    """Each searched parameter's share of the metric's variation over completed trials (Optuna's PED-ANOVA);
    None with too few completed trials or a single parameter value."""
    import optuna

    try:
        return {k: round(float(v), 4) for k, v in optuna.importance.get_param_importances(study).items()}
    except (ValueError, RuntimeError, ZeroDivisionError) as err:
        log.info("no parameter importance for study %s: %s", study.study_name, err)
        return None


def summarize(name: str, run: tuple[str, str] | None = None) -> dict[str, Any]:
    """The study's summary: best trial and params, the baseline's value, trials by state, importance, promotion,
    and what its trials cost (the jobs of DAG run ``run``: (dag_id, run_id)) next to the gain over the baseline."""
    from core import config
    study, spec = load(name)
    trials = _trials(study)
    best = _best(study)
    baseline = next((t for t in trials if t.user_attrs.get(BASELINE_ATTR)), None)
    summary: dict[str, Any] = {
        "study": name, "family": spec.family, "metric": spec.metric, "direction": spec.direction,
        "trials_requested": spec.n_trials, "trials": _counts(study), "rounds": len(_rounds(study)),
        "stopped": study.user_attrs.get(STOPPED_ATTR),
        "best": None, "baseline": _trial_row(baseline) if baseline else None,
        "importance": importance(study), "promotion": study.user_attrs.get(PROMOTION_ATTR),
        "mlflow_parent_run_id": study.user_attrs.get(PARENT_RUN_ATTR),
    }
    if best is not None:
        result = best.user_attrs.get(RESULT_ATTR) or {}
        summary["best"] = {**_trial_row(best), "mlflow_run_id": result.get("mlflow_run_id"),
                           "model_uri": result.get("model_uri")}
        if baseline is not None and baseline.value is not None and best.value is not None:
            summary["gain_over_baseline"] = best.value - baseline.value
    if run is not None:
        from services import job_history

        cost, currency = job_history.run_cost(*run)
        gain = summary.get("gain_over_baseline")
        improvement = None if gain is None else (gain if spec.direction == "maximize" else -gain)
        summary.update(cost=cost, currency=currency, cost_note=job_history.cost_note(
            cost, currency, improvement, over="the baseline", metric=spec.metric))
    summary["note"] = run_note(summary)
    run_id = summary["mlflow_parent_run_id"]
    if run_id:
        try:
            client = mlflow_client(config.load())
            _log_parent(study, spec)
            client.set_tag(run_id, "pinflow.hpo.summary", json.dumps(summary, default=str)[:5000])
            client.set_tag(run_id, "mlflow.note.content", summary["note"])
            client.set_terminated(run_id, "FINISHED")
        except Exception as err:  # noqa: BLE001 - the summary is the task's result either way
            log.warning("could not close the MLflow parent run %s: %s", run_id, err)
    return summary


def run_note(summary: dict[str, Any]) -> str:
    """The summary as a short Markdown note (the DAG run's note, the MLflow parent run's description)."""
    lines = [f"**Optuna study** `{summary['study']}`: {summary['direction']} `{summary['metric']}` of {summary['family']}"]
    counts = summary["trials"]
    lines.append("trials: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" (of {summary['trials_requested']})")
    best = summary.get("best")
    if best:
        lines.append(f"best: trial {best['number']}, {summary['metric']} {best['value']:.4f}, params `{json.dumps(best['params'])}`")
    if summary.get("gain_over_baseline") is not None:
        lines.append(f"gain over the baseline (the family's defaults): {summary['gain_over_baseline']:+.4f}")
    if summary.get("cost_note"):
        lines.append(f"trials' {summary['cost_note']}")
    if summary.get("importance"):
        lines.append("importance: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["importance"].items()))
    promotion = summary.get("promotion")
    if promotion:
        lines.append(("promoted" if promotion.get("promoted") else "not promoted") +
                     (f" version {promotion['model_version']}" if promotion.get("model_version") else "") +
                     f": {promotion.get('reason')}")
    if summary.get("stopped"):
        lines.append(f"stopped: {summary['stopped']}")
    return "\n\n".join(lines)


