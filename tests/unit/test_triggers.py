"""The compute job trigger: a serialize() round trip, and its events on a scripted backend."""

from __future__ import annotations

import asyncio
import json

import pytest

from core.failures import FailureClass
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
                      "stall_seconds": 5.0, "home": "/h"}


class Scripted:
    name = "scripted"

    def __init__(self, states):
        self.states = list(states)
        self.cancelled = []

    def status(self, job_id):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        klass = FailureClass.USER if state is JobState.FAILED else None
        return JobStatus(job_id, state, klass, "node-0 exited with code 76" if klass else "")

    def cancel(self, job_id):
        self.cancelled.append(job_id)


def first_event(trigger, backend, monkeypatch):
    monkeypatch.setattr(ComputeJobTrigger, "_backend", lambda self: backend)

    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(go())


@pytest.mark.unit
def test_fires_once_the_job_ends(monkeypatch, tmp_path):
    backend = Scripted([JobState.PENDING, JobState.RUNNING, JobState.FAILED])
    payload = first_event(make(output_dir=str(tmp_path)), backend, monkeypatch)
    assert payload == {"backend": "batch", "job_id": "abc-123", "output_dir": str(tmp_path), "state": "FAILED",
                       "failure_class": "USER", "reason": "node-0 exited with code 76"}
    assert backend.cancelled == []


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
