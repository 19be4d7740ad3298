"""The HPO DAG's tasks: the study's own (:class:`StudyCreateOperator`, each round's :class:`StudyAskOperator` and
:class:`StudyTellOperator`, :class:`StudyPromoteOperator`, :class:`StudySummaryOperator`) and one trial as a
training job (:class:`HpoTrialOperator`, a training operator with the trial's values). Its trigger, which reports
the trial's intermediate values to the study and prunes it: ``operators.hpo_trigger``; the study itself:
``operators.hpo``. The HPO DAG's parse imports this module: what only runs in the task (the study, Optuna) or in
the triggerer is imported where it is used."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context

from core.failures import ConfigError, PinflowError, UserError
from operators.compute_job import JobRef, Submission, Watch
from operators.training import TUNABLE, DistributedTrainingOperator

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger


def __getattr__(name: str) -> Any:
    """The trigger's old home: a trial deferred before it moved to ``operators.hpo_trigger`` is resumed by its
    saved classpath (``operators.hpo_trial.HpoTrialTrigger``). Looked up only then, so a parse never imports it."""
    if name in ("HpoTrialTrigger", "TrialMonitor"):
        from operators import hpo_trigger

        return getattr(hpo_trigger, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the study's own tasks -----------------------------------------------------------------------------------
# Plain operators rather than @task functions: the DAG's parse time (docs/architecture.md).
class StudyCreateOperator(BaseOperator):
    """Checks the run's form and creates the study, or continues it (``hpo.create_study``): its XCom is the study
    (name, family, metric...), which promote and summary read."""

    ui_color = "#e8dcff"

    def execute(self, context: Context) -> dict[str, Any]:
        from operators import hpo
        from operators.run_conf import check_run_conf

        check_run_conf(context)
        params, run = dict(context["params"]), context["dag_run"]
        return hpo.create_study(run.dag_id, run.run_id, params, team=str(params["team"]))


class _OfStudyOperator(BaseOperator):
    """A task at the study's end: ``study`` is the study task's XCom (name, family, metric...)."""

    template_fields: Sequence[str] = ("study",)
    ui_color = "#e8dcff"

    def __init__(self, *, study: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.study = study


class StudyPromoteOperator(_OfStudyOperator):
    """Registers the best trial's model and puts it through the promotion gate (``hpo.promote_best``); its outlet
    (the champion asset) gets an event only when the model is promoted, so corpus inference does not rerun for a
    model that was not."""

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from operators import hpo
        from operators.assets import CHAMPION_MODEL_ASSET

        params = context["params"]
        decision = hpo.promote_best(self.study["study"], float(params["promotion_tolerance"]), bool(params["promote"]))
        if not decision or not decision.get("promoted"):
            raise AirflowSkipException(f"not promoted: {(decision or {}).get('reason', 'promotion switched off')}")
        context["outlet_events"][CHAMPION_MODEL_ASSET].extra = {
            "model": self.study["family"], "model_version": str(decision["model_version"])}
        return decision


class StudySummaryOperator(_OfStudyOperator):
    """The study's summary (``hpo.summarize``) in its XCom and its log; when the run ends it becomes the run's note
    (``operators.run_notes``)."""

    def execute(self, context: Context) -> dict[str, Any]:
        from operators import hpo

        run = context["dag_run"]
        result = hpo.summarize(self.study["study"], run=(run.dag_id, run.run_id))
        self.log.info("study summary:\n%s", result["note"])
        return result


class StudyAskOperator(BaseOperator):
    """Round ``round_index``'s ask: its trials (``hpo.ask_round``), which the round's trial task maps over."""

    ui_color = "#e8dcff"

    def __init__(self, *, round_index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.round_index = round_index

    def execute(self, context: Context) -> list[dict[str, Any]]:
        from operators import hpo

        run = context["dag_run"]
        return hpo.ask_round(hpo.study_name(run.dag_id, run.run_id), self.round_index)


class StudyTellOperator(BaseOperator):
    """Round ``round_index``'s tell: the study told how each trial ended (``hpo.tell_round``). Runs whatever the
    trials' states (a failed trial is a failed trial and the study goes on); the round's ask task's state
    (``ask_task_id``) says whether the round ran (skipped: the study is done; upstream_failed: an earlier task
    failed)."""

    ui_color = "#e8dcff"

    def __init__(self, *, round_index: int, ask_task_id: str, **kwargs: Any) -> None:
        super().__init__(trigger_rule="all_done", **kwargs)
        self.round_index = round_index
        self.ask_task_id = ask_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        from operators import hpo

        run, ti = context["dag_run"], context["ti"]
        states = ti.get_task_states(dag_id=run.dag_id, task_ids=[self.ask_task_id], run_ids=[run.run_id])
        ask_state = (states.get(run.run_id) or {}).get(self.ask_task_id)
        return hpo.tell_round(hpo.study_name(run.dag_id, run.run_id), self.round_index, ask_state=ask_state)


# -- the trial's task ----------------------------------------------------------------------------------------
class HpoTrialOperator(DistributedTrainingOperator):
    """One trial of a study as a training job: :class:`DistributedTrainingOperator` with the trial's values.

    ``trial`` is one element of :func:`ask_round`'s list (mapped). The job trains the family with the trial's
    RUN.json fields and params, logs ``hpo.prune_metric`` every ``hpo.report_every_steps`` steps and does not
    register its model (the best trial's is registered at the end); its job name and checkpoints are the trial's,
    so a retry resumes the trial. Always deferrable: its trigger reports the trial's intermediate values and
    prunes it. A trial that has ended (a re-run of the DAG run) returns its recorded outcome without a job.

    :param trial: the trial (from ``ask_round``).
    :param team: a team under ``teams:`` (templated).
    """

    # Not ``trial``: its values are the sampler's, never templates.
    template_fields: Sequence[str] = (*DistributedTrainingOperator.template_fields, "team")
    ui_color = "#e8dcff"

    def __init__(self, *, trial: dict[str, Any], plan: Any = None, **kwargs: Any) -> None:
        kwargs["deferrable"] = True
        super().__init__(plan=plan, **kwargs)
        self.trial = trial

    # -- what makes it a trial -----------------------------------------------------------------------------
    def job_key(self, context: Context) -> tuple[str, ...]:
        return (f"trial{int(self.trial['number'])}",)

    def _bind(self) -> None:
        trial = self.trial
        self.plan = trial["plan"]
        self.overrides = {**{k: v for k, v in trial["run"].items() if k in TUNABLE}, "params": trial["family_params"]}

    def prepare(self, context: Context, name: str, todo: Any = None) -> Submission:
        from core import config

        submission = super().prepare(context, name, todo)
        run, trial, ti = submission.settings, self.trial, context["ti"]
        submission.settings = run.replace(
            f"RUN.json of trial {trial['number']} of study {trial['study']}",
            **{k: v for k, v in trial["run"].items() if k not in TUNABLE},
            log_every=config.load().hpo.report_every_steps,  # the steps at which trials are compared
            register=False,  # only the best trial's model is registered
            run_name=f"{ti.run_id}-trial{trial['number']}-try{ti.try_number}",
            tags={**run.tags, "hpo_study": trial["study"], "hpo_trial": str(trial["number"])},
        )
        return submission

    def trigger(self, job: JobRef, watch: Watch) -> BaseTrigger:
        from operators.hpo_trigger import HpoTrialTrigger

        return HpoTrialTrigger(
            study=self.trial["study"], trial=int(self.trial["number"]), backend=job.backend, job_id=job.job_id,
            output_dir=job.output_dir, poll_seconds=watch.poll_s, stall_seconds=watch.stall_s,
            queue_timeout_seconds=watch.queue_timeout_s,
        )

    # -- the task ------------------------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        recorded = self._recorded()
        if recorded is not None:
            return recorded
        self._bind()
        try:
            return super().execute(context)
        except PinflowError as err:
            self._record_error(err)
            raise

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None,
                         job: dict[str, Any] | None = None) -> Any:
        from operators.hpo import PRUNED

        self._bind()
        if event and event.get("state") == PRUNED:
            return self._pruned(context, event)
        try:
            return super().execute_complete(context, event, job)
        except PinflowError as err:
            self._record_error(err)
            raise

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
        from operators import hpo
        from training.evaluate import flat_metrics

        result = super().finish(context, job)
        study, spec = hpo.load(self.trial["study"])
        metrics = flat_metrics(result.get("metrics") or {}, prefix="")
        if spec.metric not in metrics:
            raise ConfigError(
                f"trial {self.trial['number']}: the family's evaluation has no metric {spec.metric!r} (param metric); "
                f"it has {', '.join(sorted(metrics))}"
            )
        self._report_final(job)
        outcome = {
            "state": "COMPLETE", "trial": self.trial["number"], "study": self.trial["study"],
            "value": metrics[spec.metric], "params": self.trial["params"], "metrics": result.get("metrics"),
            "mlflow_run_id": result.get("mlflow_run_id"), "model_uri": result.get("model_uri"),
            "model_name": result.get("model_name"), "family": result.get("family"), "eval_ds": result.get("eval_ds"),
            "train_days": result.get("train_days"), "steps": result.get("steps"), "job": job.job_id,
            "sharded_table_rows": result.get("sharded_table_rows"),
        }
        self._record(study, outcome)
        self.log.info("trial %d complete: %s %s with %s", self.trial["number"], spec.metric, outcome["value"],
                      json.dumps(self.trial["params"]))
        return outcome

    def _report_final(self, job: JobRef) -> None:
        """The whole curve of an ended trial, for the pruner's comparisons (the trigger may have missed the end)."""
        from operators.hpo_trigger import TrialMonitor

        try:
            TrialMonitor(self.trial["study"], int(self.trial["number"]), str(job.output_dir)).report()
        except Exception as err:  # noqa: BLE001 - the curve helps pruning later trials; the result is what counts
            self.log.warning("trial %d: could not report its last intermediate values: %s", self.trial["number"], err)

    def _pruned(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger pruned the trial and cancelled its job: the task succeeds with the trial recorded as pruned."""
        from core import config
        from operators import hpo
        from operators.hpo import PRUNED
        from operators.hpo_trigger import TrialMonitor
        self._forget(context)
        self._job = None
        outcome = {"state": PRUNED, "trial": self.trial["number"], "study": self.trial["study"],
                   "step": event.get("step"), "value": event.get("value"), "params": self.trial["params"],
                   "reason": event.get("reason"), "job": event.get("job_id")}
        study, _ = hpo.load(self.trial["study"])
        self._record(study, outcome)
        try:  # the job history: cancelled, not failed
            from services import job_history

            job_history.note(job_history.mark_ended, event["backend"], event["job_id"], job_history.CANCELLED,
                             reason=event.get("reason"), started_at=event.get("started_at"),
                             queued_s=event.get("queued_s"))
        except Exception as err:  # noqa: BLE001 - the study has the record
            self.log.warning("could not record pruned job %s in the job history: %s", event.get("job_id"), err)
        monitor = TrialMonitor(self.trial["study"], int(self.trial["number"]), str(event.get("output_dir")))
        run_id = monitor.mlflow_run_id()
        if run_id:
            try:
                client = hpo.mlflow_client(config.load())
                monitor.link(client, run_id, study)
                client.set_tag(run_id, "pinflow.hpo.state", PRUNED)
                client.set_terminated(run_id, "KILLED")
            except Exception as err:  # noqa: BLE001 - the study has the record
                self.log.warning("could not mark MLflow run %s of pruned trial %d: %s", run_id, self.trial["number"], err)
        self.log.info("%s; job %s cancelled", event.get("reason"), event.get("job_id"))
        return outcome

    def _record(self, study: Any, outcome: dict[str, Any]) -> None:
        from core import config
        from operators import hpo
        from operators.hpo import RESULT_ATTR
        from operators.hpo_trigger import TrialMonitor
        study._storage.set_trial_user_attr(self._trial_id(study), RESULT_ATTR, outcome)
        if outcome.get("mlflow_run_id"):
            try:
                client = hpo.mlflow_client(config.load())
                TrialMonitor(self.trial["study"], int(self.trial["number"]), "").link(client, outcome["mlflow_run_id"], study)
                client.set_tag(outcome["mlflow_run_id"], "pinflow.hpo.state", outcome["state"])
            except Exception as err:  # noqa: BLE001
                self.log.warning("could not tag MLflow run %s: %s", outcome["mlflow_run_id"], err)

    def _trial_id(self, study: Any) -> int:
        return int(study._storage.get_trial_id_from_study_id_trial_number(study._study_id, int(self.trial["number"])))

    def _record_error(self, err: PinflowError) -> None:
        from operators import hpo
        from operators.hpo import ERROR_ATTR

        try:
            study, _ = hpo.load(self.trial["study"])
            study._storage.set_trial_user_attr(
                self._trial_id(study), ERROR_ATTR, f"{err.failure_class.value}: {str(err)[:1500]}")
        except Exception as record_err:  # noqa: BLE001 - the task fails with the original error anyway
            self.log.warning("could not record the error of trial %d: %s", self.trial["number"], record_err)

    def _recorded(self) -> dict[str, Any] | None:
        """The outcome of a trial that has ended (a re-run of the DAG run); a failed one fails again, saying so."""
        from optuna.trial import TrialState

        from operators import hpo
        from operators.hpo import ERROR_ATTR, RESULT_ATTR

        study, _ = hpo.load(self.trial["study"])
        frozen = study._storage.get_trial(self._trial_id(study))
        if frozen.state == TrialState.FAIL:
            raise UserError(f"trial {frozen.number} of study {self.trial['study']} failed in an earlier run of the study "
                            f"and is not trained again: {frozen.user_attrs.get(ERROR_ATTR, '')}")
        outcome = frozen.user_attrs.get(RESULT_ATTR)
        if outcome:
            self.log.info("trial %d has ended (%s): not training it again", frozen.number, outcome.get("state"))
            return dict(outcome)
        return None
