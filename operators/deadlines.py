"""Deadlines on the daily chain: Airflow's deadline alerts, a record of each miss and a notifier.

``deadlines:`` in the platform configuration names two (``0`` switches one off):

- ``features_built_h``: a day's ``pin_daily_features`` run done within this many hours of the day's start (its
  logical date; 30 is 06:00 UTC the next morning);
- ``champion_decision_h``: a ``pin_ranker_training`` run done (the promotion decided, its approval included) within
  this many hours of being queued (its runs are started by data, they have no logical date).

The DAGs carry them as ``DeadlineAlert``\\ s (:func:`alerts`, built at parse time from light imports). When a run has
not succeeded by then, Airflow's scheduler queues :func:`deadline_missed` to run in the triggerer with the run and
the deadline; it records the miss in the job history database (``pinflow_deadline_misses``), logs it and tells
the configured notifier (``deadlines.notifier``, any Airflow notifier with ``async_notify``: Slack, SMTP, SNS...).
Airflow makes deadlines for backfill runs too, whose logical dates are in the past: those are ignored (a backfill
rebuilds old days on purpose), as is any deadline that had passed before its run was made (a manual rebuild of a
past day). The listener :func:`on_dag_run_success` / :func:`on_dag_run_failed` stamps when the
run ended, so the Platform page shows how late it was (or is, while it still runs).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.listeners import hookimpl
from airflow.sdk import DAG as _SdkDAG

if TYPE_CHECKING:
    from core.config import PlatformConfig

log = logging.getLogger(__name__)

# Which configured deadline each DAG has: (its name, the config key, what "done" means, the reference's kind).
DEADLINES = {
    "pin_daily_features": ("features built", "features_built_h", "logical_date"),
    "pin_ranker_training": ("champion decision", "champion_decision_h", "queued_at"),
}


class DAG(_SdkDAG):
    """Airflow's DAG, whose ``test()`` (``airflow dags test``, the demo) runs without its deadline alerts.

    Airflow 3.3.2's ``DAG.test()`` builds its run's DAG from the serialized form without writing the alerts to the
    database, so at the run's end ``DagRun.update_state`` looks up the encoded alerts as database ids and fails the
    run ("'dict' object has no attribute 'hex'"). A test run is not a scheduled one: it has no deadline to miss."""

    def test(self, *args: Any, **kwargs: Any) -> Any:
        alerts, self.deadline = self.deadline, None
        try:
            return super().test(*args, **kwargs)
        finally:
            self.deadline = alerts


def alerts(cfg: PlatformConfig, dag_id: str) -> list[Any]:
    """The DAG's deadline alerts from the configuration (none when switched off or for another DAG)."""
    from airflow.sdk.definitions.callback import AsyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    if dag_id not in DEADLINES:
        return []
    name, key, reference = DEADLINES[dag_id]
    hours = float(getattr(cfg.deadlines, key))
    if not hours:
        return []
    return [DeadlineAlert(
        reference=DeadlineReference.DAGRUN_LOGICAL_DATE if reference == "logical_date" else DeadlineReference.DAGRUN_QUEUED_AT,
        interval=timedelta(hours=hours),
        callback=AsyncCallback(deadline_missed, kwargs={"name": name, "hours": hours}),
        name=name,
    )]


def _time(value: Any) -> dt.datetime | None:
    if value is None or value == "":
        return None
    when = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def describe(name: str, hours: float, dag_run: dict[str, Any], deadline_at: dt.datetime | None) -> str:
    return (f"deadline missed: {dag_run.get('dag_id')} run {dag_run.get('dag_run_id')} was not done "
            f"({name}, {hours:g} h after its {'logical date' if dag_run.get('logical_date') else 'queueing'}) by "
            f"{deadline_at.isoformat() if deadline_at else '?'}; state {dag_run.get('state')}")


def record(name: str, dag_run: dict[str, Any], deadline_at: dt.datetime | None, notified: str) -> bool:
    """Write the miss (once per run and deadline); True if it is new."""
    from services import job_history

    ended = dag_run.get("state") in ("success", "failed")  # a run that failed before its deadline has missed it too
    return job_history.record_deadline_miss({
        "dag_id": dag_run.get("dag_id"), "run_id": dag_run.get("dag_run_id"), "run_type": dag_run.get("run_type"),
        "deadline": name, "deadline_at": deadline_at or job_history.now(), "noticed_at": job_history.now(),
        "run_ended_at": _time(dag_run.get("end_date")) if ended else None, "run_state": dag_run.get("state"),
        "notified": notified[:1000],
    })


async def _notify(cfg: PlatformConfig, context: dict[str, Any]) -> str:
    """Tell the configured notifier; returns what to record (its name, or why it failed). Never raises: the miss
    is recorded either way."""
    if not cfg.deadlines.notifier:
        return ""
    from airflow.sdk._shared.module_loading import import_string

    path = cfg.deadlines.notifier
    try:
        notifier = import_string(path)(**cfg.deadlines.notifier_kwargs)
        notifier.context = context
        await notifier  # BaseNotifier: renders its templated fields with the context, then async_notify
        return path
    except Exception as err:  # noqa: BLE001 - a broken notifier must not lose the record of the miss
        log.error("could not tell %s of the missed deadline (check deadlines.notifier and notifier_kwargs): %s",
                  path, err)
        return f"{path} failed: {err}"


async def deadline_missed(name: str, hours: float, context: dict[str, Any] | None = None) -> str:
    """Airflow's callback for a missed deadline (run in the triggerer; ``context`` is ``{"dag_run": ...,
    "deadline": {"id", "deadline_time"}}`` as the scheduler sends it)."""
    from core import config

    context = context or {}
    dag_run = dict(context.get("dag_run") or {})
    deadline_at = _time((context.get("deadline") or {}).get("deadline_time"))
    if str(dag_run.get("run_type")) == "backfill":
        log.info("deadline %s of backfill run %s ignored: a backfill rebuilds past days on purpose", name,
                 dag_run.get("dag_run_id"))
        return "ignored: backfill"
    created = _time(dag_run.get("queued_at") or dag_run.get("run_after"))
    if deadline_at is not None and created is not None and deadline_at <= created:
        log.info("deadline %s of run %s ignored: it had passed (%s) before the run was made (a rebuild of a past day)",
                 name, dag_run.get("dag_run_id"), deadline_at.isoformat())
        return "ignored: a rebuild of a past day"
    message = describe(name, hours, dag_run, deadline_at)
    log.warning("%s", message)
    cfg = config.load()
    notified = await _notify(cfg, {**context, "pinflow_deadline": {"name": name, "hours": hours, "message": message}})
    await asyncio.to_thread(record, name, dag_run, deadline_at, notified)  # a database write: off the event loop
    return message


def _ended(dag_run: Any) -> None:
    from services import job_history

    if getattr(dag_run, "dag_id", None) not in DEADLINES:
        return
    try:
        job_history.deadline_run_ended(dag_run.dag_id, dag_run.run_id, _time(getattr(dag_run, "end_date", None))
                                       or job_history.now(), str(getattr(dag_run, "state", "")))
    except Exception as err:  # noqa: BLE001 - a listener must not fail the scheduler's loop
        log.warning("could not stamp the end of %s %s on its missed deadlines: %s", dag_run.dag_id, dag_run.run_id, err)


@hookimpl
def on_dag_run_success(dag_run: Any, msg: str) -> None:
    _ended(dag_run)


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    _ended(dag_run)
