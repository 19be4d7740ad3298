"""One trial of a study as a training job: its task (:class:`HpoTrialOperator`, a training operator with the
trial's values) and its trigger (:class:`HpoTrialTrigger`), which reports the trial's intermediate values to the
study (:class:`TrialMonitor`) and prunes it. The study itself: ``operators.hpo``."""

from __future__ import annotations

import json
import math
import typing
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Context
from airflow.triggers.base import TriggerEvent

from core.failures import ConfigError, PinflowError, UserError
from operators import hpo
from operators.compute_job import JobRef, Submission, Watch
from operators.hpo import ERROR_ATTR, PARENT_RUN_ATTR, PRUNED, RESULT_ATTR
from operators.training import TUNABLE, DistributedTrainingOperator
from operators.triggers import ComputeJobTrigger

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger

    from operators.hpo_space import StudySpec


# -- a trial's intermediate values and pruning ---------------------------------------------------------------
class TrialMonitor:
    """A running trial seen from outside: its per-step metric from its MLflow run reported to the study as
    intermediate values, and the pruner's verdict. Used by the trigger while the job runs and by the operator
    when it ends (so a completed trial's curve is complete for the pruner's comparisons)."""

    def __init__(self, study: str, number: int, output_dir: str) -> None:
        self.study_name = study
        self.number = number
        self.output_dir = output_dir
        self._study: Any = None
        self._spec: StudySpec | None = None
        self._trial_id: int | None = None
        self._run_id: str | None = None
        self._linked = False

    def _load(self) -> tuple[Any, StudySpec, int]:
        if self._study is None:
            self._study, self._spec = hpo.load(self.study_name)
            self._trial_id = self._study._storage.get_trial_id_from_study_id_trial_number(
                self._study._study_id, self.number)
        assert self._spec is not None and self._trial_id is not None
        return self._study, self._spec, self._trial_id

    def mlflow_run_id(self) -> str | None:
        """The trial's MLflow run (``mlflow_run.json`` in its checkpoint folder, named by its RUN.json)."""
        if self._run_id:
            return self._run_id
        from core import storage
        from core.failures import ConfigError
        from training.config import RunConfig
        from training.tracking import STATE_FILE

        try:
            run = RunConfig.from_json(storage.join(self.output_dir, "RUN.json"))
            state = storage.read_json(storage.join(run.checkpoint_dir, STATE_FILE))
        except (OSError, ValueError, ConfigError):
            return None
        self._run_id = state.get("run_id")
        return self._run_id

    def report(self) -> int | None:
        """Report the steps not reported yet; return the last step reported (None: nothing logged yet)."""
        import optuna

        from core import config

        study, spec, trial_id = self._load()
        run_id = self.mlflow_run_id()
        if not run_id:
            return None
        client = hpo.mlflow_client(config.load())
        if not self._linked:
            self.link(client, run_id, study)
        history = client.get_metric_history(run_id, spec.prune_metric)
        frozen = study._storage.get_trial(trial_id)
        if frozen.state.is_finished():
            return frozen.last_step
        trial = optuna.trial.Trial(study, trial_id)
        done = set(frozen.intermediate_values)
        for point in sorted(history, key=lambda m: m.step):
            if point.step not in done and math.isfinite(point.value):
                trial.report(spec.prune_sign * float(point.value), int(point.step))
                done.add(point.step)
        return max(done) if done else None

    def link(self, client: Any, run_id: str, study: Any) -> None:
        """Make the trial's MLflow run a child of the study's parent run."""
        parent = study.user_attrs.get(PARENT_RUN_ATTR)
        tags = {"pinflow.hpo.study": self.study_name, "pinflow.hpo.trial": str(self.number)}
        if parent:
            tags["mlflow.parentRunId"] = str(parent)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        self._linked = True

    def should_prune(self) -> dict[str, Any] | None:
        """Report, then ask the pruner: the verdict (step, value, reason) or None."""
        import optuna

        step = self.report()
        if step is None:
            return None
        study, spec, trial_id = self._load()
        if study._storage.get_trial(trial_id).state.is_finished():
            return None
        trial = optuna.trial.Trial(study, trial_id)
        if not trial.should_prune():
            return None
        frozen = study._storage.get_trial(trial_id)
        value = frozen.intermediate_values.get(step)
        loss = None if value is None else spec.prune_sign * value
        return {"step": step, "value": value, "reason": (
            f"trial {self.number} pruned at step {step}: {spec.prune_metric} {loss} is worse than the median of the "
            f"completed trials at that step ({spec.pruner} pruner)")}


class HpoTrialTrigger(ComputeJobTrigger):
    """:class:`ComputeJobTrigger` for a trial: while the job runs, report its intermediate values to the study and
    cancel it when the pruner says so; the event then has state ``PRUNED`` (the job's own end otherwise).

    Serialises only ids and settings: the study's name and the trial's number besides the job's; the study storage
    comes from the platform config in the triggerer.
    """

    def __init__(self, *, study: str, trial: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.study = study
        self.trial = int(trial)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {**kwargs, "study": self.study, "trial": self.trial}

    def _check(self, monitor: TrialMonitor) -> dict[str, Any] | None:
        try:
            return monitor.should_prune()
        except Exception as err:  # noqa: BLE001 - pruning is an optimisation: never fail a trial over it
            self.log.warning("trial %d: could not report or check pruning: %s", self.trial, err)
            return None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import asyncio

        monitor = TrialMonitor(self.study, self.trial, str(self.output_dir))
        inner = typing.cast(Any, super().run())  # an async generator: closed below
        pending = asyncio.ensure_future(inner.__anext__())
        verdict: dict[str, Any] | None = None
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.poll_seconds)
                if pending in done:
                    event = pending.result()
                    break
                if verdict is None:
                    verdict = await asyncio.to_thread(self._check, monitor)
                    if verdict is not None:
                        self.log.info("%s: cancelling job %s", verdict["reason"], self.job_id)
                        try:
                            backend = await asyncio.to_thread(self._backend)
                            await asyncio.to_thread(backend.cancel, self.job_id)
                        except Exception as err:  # noqa: BLE001 - not pruned after all: the job runs to its end
                            self.log.warning("could not cancel job %s to prune it: %s", self.job_id, err)
                            verdict = None
        finally:
            if not pending.done():
                pending.cancel()
            await inner.aclose()
        payload = dict(event.payload)
        if verdict is not None and payload.get("state") != "SUCCEEDED":
            payload.update(state=PRUNED, failure_class=None, reason=verdict["reason"], step=verdict["step"],
                           value=verdict["value"])
        yield TriggerEvent(payload)


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
        self._bind()
        if event and event.get("state") == PRUNED:
            return self._pruned(context, event)
        try:
            return super().execute_complete(context, event, job)
        except PinflowError as err:
            self._record_error(err)
            raise

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
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
        try:
            TrialMonitor(self.trial["study"], int(self.trial["number"]), str(job.output_dir)).report()
        except Exception as err:  # noqa: BLE001 - the curve helps pruning later trials; the result is what counts
            self.log.warning("trial %d: could not report its last intermediate values: %s", self.trial["number"], err)

    def _pruned(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger pruned the trial and cancelled its job: the task succeeds with the trial recorded as pruned."""
        from core import config
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
        try:
            study, _ = hpo.load(self.trial["study"])
            study._storage.set_trial_user_attr(
                self._trial_id(study), ERROR_ATTR, f"{err.failure_class.value}: {str(err)[:1500]}")
        except Exception as record_err:  # noqa: BLE001 - the task fails with the original error anyway
            self.log.warning("could not record the error of trial %d: %s", self.trial["number"], record_err)

    def _recorded(self) -> dict[str, Any] | None:
        """The outcome of a trial that has ended (a re-run of the DAG run); a failed one fails again, saying so."""
        from optuna.trial import TrialState

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
