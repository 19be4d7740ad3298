"""The operator's synchronous path (``wait_for_job``): queue wait is not a stall, the queue timeout has its own
error, the returned status carries the queue wait. Time is a fake clock moved a minute per status call."""

from __future__ import annotations

import functools
import json

import pytest

from core.failures import FailureClass, InfraError
from operators import jobs
from operators.backends import JobState, JobStatus
from operators.jobs import JobWatch, QueueTimeoutError, wait_for_job

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, now: float = 5_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Scripted:
    name = "scripted"

    def __init__(self, states, clock, created_at=None):
        self.states, self.clock, self.created_at = list(states), clock, created_at
        self.cancelled: list[str] = []

    def status(self, job_id):
        self.clock.now += 60
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return JobStatus(job_id, state, reason="RUNNABLE" if state is JobState.PENDING else "",
                         created_at=self.created_at)

    def cancel(self, job_id):
        self.cancelled.append(job_id)

    def logs(self, job_id, tail=50):
        return ""


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(jobs, "JobWatch", functools.partial(JobWatch, clock=fake, wall=fake))
    return fake


def wait(backend, tmp_path, **kw):
    return wait_for_job(backend, "j1", output_dir=tmp_path, poll_seconds=0, sleep=lambda s: None, what="training job",
                        **{"stall_seconds": 300, **kw})


def test_pending_for_an_hour_then_running_is_not_cancelled(tmp_path, clock):
    (tmp_path / "heartbeat-rank0.json").write_text(json.dumps({"progress": 0}))
    backend = Scripted([JobState.PENDING] * 60 + [JobState.RUNNING, JobState.SUCCEEDED], clock, created_at=clock.now)
    status = wait(backend, tmp_path, queue_timeout_seconds=86400)
    assert status.state is JobState.SUCCEEDED and backend.cancelled == []
    assert status.queued_s == 3660.0  # created, 61 looks at a minute each, running at the 61st


def test_the_queue_timeout_cancels_and_raises_its_own_error(tmp_path, clock):
    backend = Scripted([JobState.PENDING], clock, created_at=clock.now)
    with pytest.raises(QueueTimeoutError) as err:
        wait(backend, tmp_path, queue_timeout_seconds=600)
    assert backend.cancelled == ["j1"]
    assert isinstance(err.value, InfraError) and err.value.failure_class is FailureClass.INFRA  # retried
    assert str(err.value).startswith("training job j1 waited 660s queued (RUNNABLE) without starting, longer than "
                                     "the queue timeout of 600s (training.queue_timeout_seconds)")


def test_no_queue_timeout_when_zero(tmp_path, clock):
    backend = Scripted([JobState.PENDING] * 3000 + [JobState.SUCCEEDED], clock)
    assert wait(backend, tmp_path, queue_timeout_seconds=0).state is JobState.SUCCEEDED


def test_a_running_job_without_progress_stalls(tmp_path, clock):
    (tmp_path / "heartbeat-rank0.json").write_text(json.dumps({"progress": 7}))
    backend = Scripted([JobState.PENDING] * 30 + [JobState.RUNNING], clock)
    with pytest.raises(InfraError, match="made no progress for 300s") as err:
        wait(backend, tmp_path)
    assert not isinstance(err.value, QueueTimeoutError) and backend.cancelled == ["j1"]


def test_watch_counts_every_queued_spell_and_restarts_the_stall_clock():
    """A Batch retry after a lost host puts the job back in the queue: that wait is not a stall either."""
    clock = Clock(0.0)
    watch = JobWatch(300, 1000, clock=clock, wall=clock)
    pending, running = JobStatus("j", JobState.PENDING), JobStatus("j", JobState.RUNNING)
    for state, at in [(pending, 0), (pending, 500), (running, 600), (running, 800), (pending, 900), (pending, 1800)]:
        clock.now = at
        assert watch.observe(state) is None  # the second queued spell is 900 s: under the timeout
    clock.now = 2000
    assert watch.observe(running) is None and watch.running and watch.queued_s == 600 + 1100
    assert watch.stalled([{"progress": 1}]) is False  # first heartbeat after the restart: progress
    clock.now = 2301
    assert watch.stalled([{"progress": 1}]) is True
    clock.now = 2400
    assert watch.observe(pending) is None and not watch.stalled([{"progress": 1}])  # queued again: no stall
    clock.now = 3401
    verdict = watch.observe(pending)
    assert verdict is not None and verdict[0] == jobs.QUEUE_TIMEOUT and "waited 1001s" in verdict[1]
    assert watch.times() == {"created_at": 0.0, "started_at": 600.0, "queued_s": 1700.0}
