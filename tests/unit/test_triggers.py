"""The compute job trigger: a serialize() round trip, and its events on a scripted backend.

A queued job is not a stalled one: heartbeats count only once the job runs; a separate queue timeout cancels a
job that never starts. Time is a fake clock that each status call moves on by a minute.
"""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from core.failures import FailureClass
from operators import jobs
from operators.backends import JobState, JobStatus
from operators.triggers import ComputeJobTrigger


def make(**change):
    kwargs = dict(backend="batch", job_id="abc-123", output_dir="/tmp/x", poll_seconds=0.01, stall_seconds=5.0, home="/h")
    return ComputeJobTrigger(**{**kwargs, **change})


@pytest.mark.unit
def test_serialize_round_trip_holds_only_ids_and_settings():
    classpath, kwargs = make().serialize()
    assert classpath == "operators.triggers.ComputeJobTrigger"
    json.dumps(kwargs)  # nothing but plain values
    from airflow.sdk._shared.module_loading import import_string

    again = import_string(classpath)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs == {"backend": "batch", "job_id": "abc-123", "output_dir": "/tmp/x", "poll_seconds": 0.01,
                      "stall_seconds": 5.0, "queue_timeout_seconds": 0.0, "home": "/h", "shard_markers": None}


class Scripted:
    """A backend that answers a scripted list of states, the last one for ever; each call moves ``clock`` on."""

    name = "scripted"

    def __init__(self, states, clock=None, step=60.0, created_at=None):
        self.states = list(states)
        self.cancelled = []
        self.clock, self.step, self.created_at = clock, step, created_at

    def status(self, job_id):
        if self.clock is not None:
            self.clock.now += self.step
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        klass = FailureClass.USER if state is JobState.FAILED else None
        return JobStatus(job_id, state, klass, "node-0 exited with code 76" if klass else
                         ("RUNNABLE" if state is JobState.PENDING else ""), created_at=self.created_at)

    def cancel(self, job_id):
        self.cancelled.append(job_id)


def first_event(trigger, backend, monkeypatch):
    monkeypatch.setattr(ComputeJobTrigger, "_backend", lambda self: backend)

    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(go())


class Clock:
    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """The watch's monotonic and wall clocks, moved by the scripted backend (asyncio keeps the real one)."""
    fake = Clock()
    monkeypatch.setattr(jobs, "JobWatch", functools.partial(jobs.JobWatch, clock=fake, wall=fake))
    return fake


@pytest.mark.unit
def test_fires_once_the_job_ends_with_its_queue_wait(monkeypatch, tmp_path, clock):
    backend = Scripted([JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.FAILED], clock,
                       created_at=clock.now)
    payload = first_event(make(output_dir=str(tmp_path), poll_seconds=0), backend, monkeypatch)
    assert payload == {"backend": "batch", "job_id": "abc-123", "output_dir": str(tmp_path), "state": "FAILED",
                       "failure_class": "USER", "reason": "node-0 exited with code 76",
                       "created_at": 1_000_000.0, "started_at": 1_000_180.0, "queued_s": 180.0}
    assert backend.cancelled == []


@pytest.mark.unit
def test_a_job_queued_longer_than_the_heartbeat_timeout_is_not_cancelled(monkeypatch, tmp_path, clock):
    """Held RUNNABLE / by Kueue for an hour (heartbeat timeout 300 s, no heartbeat yet): it then runs and succeeds."""
    (tmp_path / "heartbeat-rank0.json").write_text(json.dumps({"progress": 0, "step": 0}))
    backend = Scripted([JobState.PENDING] * 60 + [JobState.RUNNING, JobState.SUCCEEDED], clock)
    payload = first_event(make(output_dir=str(tmp_path), poll_seconds=0, stall_seconds=300,
                               queue_timeout_seconds=86400), backend, monkeypatch)
    assert payload["state"] == "SUCCEEDED" and backend.cancelled == []
    assert payload["queued_s"] == 3600.0


@pytest.mark.unit
def test_the_stall_clock_starts_when_the_job_runs(monkeypatch, tmp_path, clock):
    (tmp_path / "heartbeat-rank0.json").write_text(json.dumps({"progress": 3, "step": 3}))
    backend = Scripted([JobState.PENDING] * 20 + [JobState.RUNNING], clock)
    payload = first_event(make(output_dir=str(tmp_path), poll_seconds=0, stall_seconds=300), backend, monkeypatch)
    # 20 minutes queued, then no progress: stalled 5 minutes after it started running, not at submission.
    assert payload["state"] == "STALLED" and backend.cancelled == ["abc-123"]
    assert payload["started_at"] == 1_000_000.0 + 21 * 60 and clock.now - payload["started_at"] > 300
    assert clock.now - payload["started_at"] <= 300 + 2 * 60


@pytest.mark.unit
def test_the_queue_timeout_cancels_with_its_own_message(monkeypatch, tmp_path, clock):
    backend = Scripted([JobState.PENDING], clock, created_at=clock.now)
    payload = first_event(make(output_dir=str(tmp_path), poll_seconds=0, stall_seconds=300,
                               queue_timeout_seconds=1800), backend, monkeypatch)
    assert payload["state"] == "QUEUE_TIMEOUT" and payload["failure_class"] == "INFRA"
    assert backend.cancelled == ["abc-123"]
    assert payload["reason"].startswith("job abc-123 waited 1860s queued (RUNNABLE) without starting, longer than "
                                        "the queue timeout of 1800s (training.queue_timeout_seconds); cancelled it")
    assert payload["started_at"] is None and payload["queued_s"] is None


@pytest.mark.unit
def test_stalled_heartbeats_cancel_the_job(monkeypatch, tmp_path):
    (tmp_path / "heartbeat-rank0.json").write_text(json.dumps({"progress": 3, "step": 3}))
    backend = Scripted([JobState.RUNNING])
    payload = first_event(make(output_dir=str(tmp_path), stall_seconds=0.05), backend, monkeypatch)
    assert payload["state"] == "STALLED" and payload["failure_class"] == "INFRA"
    assert "no progress" in payload["reason"] and backend.cancelled == ["abc-123"]


@pytest.mark.unit
def test_on_kill_cancels(monkeypatch):
    backend = Scripted([JobState.RUNNING])
    monkeypatch.setattr(ComputeJobTrigger, "_backend", lambda self: backend)
    asyncio.run(make().on_kill())
    assert backend.cancelled == ["abc-123"]


@pytest.mark.unit
def test_a_task_stopped_from_airflow_leaves_its_job_cancelled_not_failed(monkeypatch, tmp_path):
    """Marking a deferred task failed kills its trigger: the history says CANCELLED (before the job's exit, as a killed
    process, could be read as an INFRA failure), and reconciling afterwards leaves it so."""
    from operators import quotas
    from services import job_history as history

    url = f"sqlite:///{tmp_path}/jobs.db"
    monkeypatch.setattr(history, "default_url", lambda: url)
    history.upsert("train-killed", url, team="ranking", state=history.RUNNING, backend="batch", job_id="abc-123",
                   nodes=1, gpus=8)
    backend = Scripted([JobState.FAILED])
    monkeypatch.setattr(ComputeJobTrigger, "_backend", lambda self: backend)
    asyncio.run(make().on_kill())
    quotas.reconcile("ranking", url, backends={"batch": backend})
    row = history.get("train-killed", url)
    assert (row["state"], row["failure_class"], row["reason"]) == ("CANCELLED", None, history.STOPPED_BY_A_PERSON)


@pytest.mark.unit
def test_in_a_triggerer_a_job_that_has_already_ended_is_reported_no_sooner_than_the_minimum_delay(monkeypatch):
    """Airflow 3.3 fails a resumed task whose trigger fired before the scheduler saw the deferring worker exit
    (apache/airflow#72716): in a triggerer (which sets trigger_id) the event waits until MIN_SECONDS_TO_EVENT after
    the trigger started; run inline (dag.test(), these tests: no trigger_id) it comes at once."""
    import operators.triggers as triggers

    slept = []

    async def record(seconds):
        slept.append(seconds)

    monkeypatch.setattr(triggers.asyncio, "sleep", record)
    inline = make()
    assert first_event(inline, Scripted([JobState.SUCCEEDED]), monkeypatch)["state"] == "SUCCEEDED" and slept == []
    in_triggerer = make()
    in_triggerer.trigger_id = 7
    assert first_event(in_triggerer, Scripted([JobState.SUCCEEDED]), monkeypatch)["state"] == "SUCCEEDED"
    assert len(slept) == 1 and 9.0 < slept[0] <= triggers.MIN_SECONDS_TO_EVENT == 10.0, slept


@pytest.mark.unit
def test_while_an_array_job_runs_the_log_counts_its_shards_built(monkeypatch, tmp_path):
    """A shard counts once every output of the step has its marker (user_daily and pin_daily for the daily step)."""
    def built(index, *datasets):
        for dataset in datasets:
            marker = tmp_path / "features" / dataset / f"shard-{index:05d}" / "_SUCCESS"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    class Building(Scripted):
        polls = 0

        def status(self, job_id):
            self.polls += 1
            if self.polls == 3:
                built(0, "user_daily", "pin_daily")
                built(1, "user_daily")  # half-written: not counted yet
            if self.polls == 4:
                built(1, "pin_daily")
            if self.polls == 6:
                built(2, "user_daily", "pin_daily")  # between the last poll while running and the end
            return super().status(job_id)

    class Lines:  # the trigger's log (structlog's in Airflow 3, which caplog does not see)
        def __init__(self):
            self.lines = []

        def info(self, message, *args):
            self.lines.append(message % args)

        warning = debug = info

    log = Lines()
    monkeypatch.setattr(ComputeJobTrigger, "log", log)
    markers = jobs.ShardMarkers(str(tmp_path), ("features/user_daily/shard-*/_SUCCESS", "features/pin_daily/shard-*/_SUCCESS"), 3)
    backend = Building([JobState.RUNNING] * 5 + [JobState.SUCCEEDED])
    payload = first_event(make(output_dir=None, poll_seconds=0, shard_markers=markers.to_list()), backend, monkeypatch)
    assert payload["state"] == "SUCCEEDED"
    assert [line for line in log.lines if "shard(s) built" in line] == [
        f"job abc-123: {n} of 3 shard(s) built" for n in (0, 1, 2, 3)]


@pytest.mark.unit
def test_a_shard_counts_as_built_once_it_has_every_output(tmp_path):
    for dataset, shards in (("user_daily", (0, 1)), ("pin_daily", (0, 2))):
        for index in shards:
            marker = tmp_path / dataset / f"shard-{index:05d}" / "_SUCCESS"
            marker.parent.mkdir(parents=True)
            marker.touch()
    counter = jobs.ShardCounter(jobs.ShardMarkers(str(tmp_path), ("user_daily/shard-*/_SUCCESS", "pin_daily/shard-*/_SUCCESS"), 3))
    assert (counter.line(), counter.line()) == ("1 of 3 shard(s) built", None)  # shard 0 only; said once
    assert jobs.ShardCounter(jobs.ShardMarkers(str(tmp_path / "nothing-yet"), ("x/shard-*/_SUCCESS",), 3)).line() == (
        "0 of 3 shard(s) built")
