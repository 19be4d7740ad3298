"""Deadlines on the daily chain (issue 36, 3): the DAGs' deadline alerts from the configuration, and the callback
that Airflow's scheduler queues for a missed one, run through Airflow's own ``CallbackTrigger`` (what the triggerer
runs) with the context the scheduler sends: the miss is recorded once, its notifier told, backfills and rebuilds of
past days ignored; the Platform page shows how late the run was."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core import config
from core.config import DeadlinesConfig, JobHistoryConfig, PlatformConfig
from operators import deadlines
from services import job_history as history

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit
DUE = dt.datetime(2026, 11, 21, 6, 0, tzinfo=dt.UTC)


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PlatformConfig:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "notifiers"))
    cfg = PlatformConfig(home=str(tmp_path), job_history=JobHistoryConfig(url=f"sqlite:///{tmp_path / 'history.db'}"),
                         deadlines=DeadlinesConfig(notifier="file_notifier.FileNotifier", notifier_kwargs={
                             "path": str(tmp_path / "sent.txt"),
                             "text": "{{ dag_run.dag_id }} {{ pinflow_deadline.name }}: {{ pinflow_deadline.message }}"}))
    monkeypatch.setattr(config, "load", lambda: cfg)
    return cfg


def scheduler_context(run_type: str = "scheduled", queued_at: dt.datetime | None = None, **run: Any) -> dict[str, Any]:
    """What ``Deadline.handle_miss`` sends: the run (DAGRunResponse as JSON) and the deadline."""
    return {"dag_run": {"dag_id": "pin_daily_features", "dag_run_id": f"{run_type}__2026-11-20T00:00:00+00:00",
                        "run_type": run_type, "logical_date": "2026-11-20T00:00:00Z", "state": "running",
                        "queued_at": (queued_at or dt.datetime(2026, 11, 21, 0, 0, 5, tzinfo=dt.UTC)).isoformat(),
                        **run},
            "deadline": {"id": "d1", "deadline_time": DUE}}


def fire(context: dict[str, Any], name: str = "features built", hours: float = 30.0) -> dict[str, Any]:
    from airflow.triggers.callback import CallbackTrigger

    trigger = CallbackTrigger("operators.deadlines.deadline_missed",
                              {"name": name, "hours": hours, "context": context})

    async def events() -> list[Any]:
        return [event.payload async for event in trigger.run()]

    *_, last = asyncio.run(events())
    assert last["state"] == "success", last
    return dict(last)


def test_each_dag_of_the_chain_has_its_deadline_from_the_configuration():
    from airflow.sdk.definitions.deadline import DagRunLogicalDateDeadline, DagRunQueuedAtDeadline

    cfg = PlatformConfig(deadlines=DeadlinesConfig(features_built_h=30, champion_decision_h=4))
    [features] = deadlines.alerts(cfg, "pin_daily_features")
    [decision] = deadlines.alerts(cfg, "pin_ranker_training")
    assert isinstance(features.reference, DagRunLogicalDateDeadline) and features.interval == dt.timedelta(hours=30)
    assert isinstance(decision.reference, DagRunQueuedAtDeadline) and decision.interval == dt.timedelta(hours=4)
    assert features.callback.path == "operators.deadlines.deadline_missed"
    assert deadlines.alerts(cfg.model_copy(update={"deadlines": DeadlinesConfig(features_built_h=0)}),
                            "pin_daily_features") == []
    assert deadlines.alerts(cfg, "pin_corpus_inference") == []


def test_a_missed_deadline_is_recorded_once_and_its_notifier_told(platform, tmp_path):
    context = scheduler_context()
    body = fire(context)["body"]
    assert body.startswith("deadline missed: pin_daily_features run scheduled__2026-11-20T00:00:00+00:00 was not done "
                           "(features built, 30 h after its logical date) by 2026-11-21T06:00:00+00:00")
    fire(scheduler_context())  # the callback run again (a retried trigger): one row
    [miss] = history.deadline_misses_since(DUE - dt.timedelta(days=1))
    assert (miss["deadline"], miss["deadline_at"], miss["run_ended_at"]) == ("features built", DUE, None)
    assert miss["notified"] == "file_notifier.FileNotifier"
    sent = (tmp_path / "sent.txt").read_text().splitlines()
    assert sent[0] == f"pin_daily_features features built: {body}" and len(sent) == 2


def test_backfills_and_rebuilds_of_past_days_are_not_late(platform, tmp_path):
    assert fire(scheduler_context("backfill"))["body"] == "ignored: backfill"
    rebuild = scheduler_context("manual", queued_at=DUE + dt.timedelta(days=3))
    assert fire(rebuild)["body"] == "ignored: a rebuild of a past day"
    assert history.deadline_misses_since(DUE - dt.timedelta(days=1)) == [] and not (tmp_path / "sent.txt").exists()


def test_a_broken_notifier_still_records_the_miss(platform, monkeypatch):
    broken = platform.model_copy(update={"deadlines": platform.deadlines.model_copy(
        update={"notifier": "file_notifier.NoSuchNotifier"})})
    monkeypatch.setattr(config, "load", lambda: broken)
    fire(scheduler_context())
    [miss] = history.deadline_misses_since(DUE - dt.timedelta(days=1))
    assert miss["notified"].startswith("file_notifier.NoSuchNotifier failed:")


def test_the_platform_page_shows_how_late_each_run_was(platform):
    sys.path.insert(0, str(REPO / "plugins"))
    try:
        from pinflow_ui import pages, web
    finally:
        sys.path.remove(str(REPO / "plugins"))

    fire(scheduler_context())
    now = DUE + dt.timedelta(minutes=50)
    [running] = pages.deadline_misses(DUE - dt.timedelta(days=1), now)
    assert (running["late_s"], running["still_running"]) == (3000.0, True)
    # The run ends (the listener): how late it was is fixed.
    deadlines.on_dag_run_success(SimpleNamespace(dag_id="pin_daily_features", run_id=running["run_id"],
                                                 end_date=DUE + dt.timedelta(minutes=20), state="success"), "")
    [ended] = pages.deadline_misses(DUE - dt.timedelta(days=1), now)
    assert (ended["late_s"], ended["still_running"], ended["run_state"]) == (1200.0, False, "success")
    data = {**pages.platform(platform, days=14, now=now), "deadline_misses": [ended]}
    html = web.render_platform(SimpleNamespace(scope={"root_path": "/pinflow"}), data)
    section = html.split("<h2>Missed deadlines</h2>")[1].split("<h2>")[0]
    assert "features built" in section and "20.0 min (success)" in section, section
