"""Triggers: wait for a compute job in the triggerer, off the worker slots."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

# Airflow 3.3 fails a deferred task when the scheduler learns that the worker which deferred it has exited only after
# the resumed try is already running (apache/airflow#71580, #72716: "Executor reported that the task instance
# finished with state success, but the task instance's state attribute is running", then a retry minutes later).
# That exit takes a few seconds to reach the scheduler, so a trigger that fires at once (a job of seconds, a quota
# with room) could lose its task to the race: in a triggerer, pinflow's triggers fire no sooner than this after they
# start.
MIN_SECONDS_TO_EVENT = 10.0


async def not_before(trigger: BaseTrigger, started: float) -> None:
    """Wait until ``MIN_SECONDS_TO_EVENT`` after ``started`` (``time.monotonic()`` when ``trigger`` started) if a
    triggerer runs it (it set ``trigger_id``); one run inline by ``dag.test()`` has no scheduler to race with."""
    remaining = MIN_SECONDS_TO_EVENT - (time.monotonic() - started)
    if trigger.trigger_id is not None and remaining > 0:
        await asyncio.sleep(remaining)


class ComputeJobTrigger(BaseTrigger):
    """Poll a job on a compute backend until it ends, its heartbeats stall, or it waits too long in its queue.

    Serialises only ids and settings (the backend's name, the job id, the heartbeat folder, the poll, stall and
    queue times); the backend is rebuilt from the platform config in the triggerer. A queued job is not a
    stalled one: heartbeats count only once the backend reports the job RUNNING (:class:`~operators.jobs.JobWatch`).
    Fires one event: ``{"backend", "job_id", "output_dir", "state", "failure_class", "reason", "created_at",
    "started_at", "queued_s"}`` with state ``SUCCEEDED``, ``FAILED``, ``STALLED`` or ``QUEUE_TIMEOUT`` (the
    last two: the trigger has cancelled the job). The times (epoch seconds; ``queued_s`` the time spent queued)
    are for the job history. The operator's ``execute_complete`` re-checks through the backend. Killing the task
    (``on_kill``) cancels the job.
    """

    def __init__(
        self,
        *,
        backend: str,
        job_id: str,
        output_dir: str | None = None,
        poll_seconds: float = 10.0,
        stall_seconds: float = 300.0,
        queue_timeout_seconds: float = 0.0,
        home: str | None = None,
        shard_markers: list[Any] | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.job_id = job_id
        self.output_dir = output_dir
        self.poll_seconds = float(poll_seconds)
        self.stall_seconds = float(stall_seconds)
        self.queue_timeout_seconds = float(queue_timeout_seconds)
        self.home = home
        self.shard_markers = shard_markers  # ShardMarkers.to_list(): an array job's shards, logged as they are built

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "backend": self.backend,
                "job_id": self.job_id,
                "output_dir": self.output_dir,
                "poll_seconds": self.poll_seconds,
                "stall_seconds": self.stall_seconds,
                "queue_timeout_seconds": self.queue_timeout_seconds,
                "home": self.home,
                "shard_markers": self.shard_markers,
            },
        )

    def _job(self) -> dict[str, Any]:
        return {"backend": self.backend, "job_id": self.job_id, "output_dir": self.output_dir}

    def _backend(self) -> Any:
        from operators.backends import get_backend

        return get_backend(self.backend, home=self.home)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from operators.jobs import (
            STALLED,
            JobWatch,
            ShardCounter,
            ShardMarkers,
            describe_beats,
            poll_delays,
            read_heartbeats,
        )

        started = time.monotonic()
        backend = await asyncio.to_thread(self._backend)
        watch = JobWatch(self.stall_seconds, self.queue_timeout_seconds)
        shards = ShardCounter(ShardMarkers.from_list(self.shard_markers))
        delays = poll_delays(self.poll_seconds)
        last_log = 0.0
        last_phase: Any = None
        was_running = False
        from services.job_history import Watching

        watching = await asyncio.to_thread(Watching, self.backend, self.job_id, self.output_dir)  # reads the config
        while True:
            # Backends are synchronous clients (boto3, kubernetes): keep them off the event loop.
            status = await asyncio.to_thread(backend.status, self.job_id)
            if status.state.terminal:
                if line := await asyncio.to_thread(shards.line):  # the count at the end, however short the job was
                    self.log.info("job %s: %s", self.job_id, line)
                if self.output_dir:  # the job's last progress, however short its last phases were between polls
                    beats = await asyncio.to_thread(read_heartbeats, self.output_dir)
                    if beats:
                        self.log.info("job %s ended: %s", self.job_id, describe_beats(beats))
                await not_before(self, started)
                yield TriggerEvent({
                    **self._job(),
                    "state": status.state.value,
                    "failure_class": status.failure_class.value if status.failure_class else None,
                    "reason": status.reason,
                    **watch.times(status),
                })
                return
            await asyncio.to_thread(watching.tick)
            verdict = watch.observe(status)
            if verdict is not None:
                await asyncio.to_thread(backend.cancel, self.job_id)
                await not_before(self, started)
                yield TriggerEvent({**self._job(), "state": verdict[0], "failure_class": "INFRA", "reason": verdict[1],
                                    **watch.times()})
                return
            if watch.running and not was_running:
                from services import job_history

                self.log.info("job %s is running after %.0fs queued", self.job_id, watch.queued_s)
                await asyncio.to_thread(job_history.note, job_history.mark_running, self.backend, self.job_id,
                                        watch.started_at, watch.queued_s)
            was_running = watch.running
            if watch.running and (line := await asyncio.to_thread(shards.line)):
                self.log.info("job %s: %s", self.job_id, line)
            if self.output_dir and watch.running:
                beats = await asyncio.to_thread(read_heartbeats, self.output_dir)
                phase = min(beats, key=lambda b: int(b.get("rank", 0))).get("phase") if beats else None
                # A progress line every 30 s, and whenever the job moves on (training, evaluating, done ...).
                if beats and (time.monotonic() - last_log > 30 or phase != last_phase):
                    last_log, last_phase = time.monotonic(), phase
                    self.log.info("job %s: %s", self.job_id, describe_beats(beats))
                if watch.stalled(beats):
                    await asyncio.to_thread(backend.cancel, self.job_id)
                    await not_before(self, started)
                    yield TriggerEvent({
                        **self._job(),
                        "state": STALLED,
                        "failure_class": "INFRA",
                        "reason": watch.heartbeats.stall_message("job", self.job_id),
                        **watch.times(),
                    })
                    return
            await asyncio.sleep(next(delays))

    async def on_kill(self) -> None:
        """The user killed the deferred task: cancel its job (not called when a triggerer restarts). The history
        says CANCELLED first: the job then exits as a killed process would (INFRA), which is not what happened."""
        from services import job_history

        backend = await asyncio.to_thread(self._backend)
        self.log.info("task killed while deferred: cancelling %s job %s", self.backend, self.job_id)
        await asyncio.to_thread(job_history.note, job_history.mark_ended, self.backend, self.job_id,
                                job_history.CANCELLED, reason=job_history.STOPPED_BY_A_PERSON)
        await asyncio.to_thread(backend.cancel, self.job_id)
