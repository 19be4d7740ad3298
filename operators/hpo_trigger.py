"""A running trial seen from the triggerer: :class:`HpoTrialTrigger` reports the trial's intermediate values to
the study (:class:`TrialMonitor`) and prunes it. Apart from the trial's task (``operators.hpo_trial``) so that
parsing the HPO DAG does not import the trigger machinery."""

from __future__ import annotations

import math
import typing
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import TriggerEvent

from operators import hpo
from operators.hpo import PARENT_RUN_ATTR, PRUNED
from operators.triggers import ComputeJobTrigger

if TYPE_CHECKING:
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
