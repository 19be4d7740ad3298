"""Watch a submitted job to its end: queue wait, progress from heartbeats, stall detection, typed failure.

A job is first queued (PENDING: waiting for capacity in a Batch queue or for Kueue's admission, instances
booting, images pulling), then RUNNING. Waiting is not stalling: the heartbeat clock starts only when the
backend reports the job RUNNING (and starts over if it goes back to the queue, as a Batch retry does). A
separate queue timeout (``training.queue_timeout_seconds``) cancels a job that never starts, with its own
message. :class:`JobWatch` holds both clocks for the trigger and for the operator's synchronous path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core import storage
from core.failures import ADVICE, ERROR_FOR_CLASS, FailureClass, InfraError
from operators.backends.base import Backend, JobState, JobStatus

# What a watcher decided and did (it cancelled the job): the trigger's event states besides the job's own end.
STALLED = "STALLED"
QUEUE_TIMEOUT = "QUEUE_TIMEOUT"
WATCHER_STATES = (STALLED, QUEUE_TIMEOUT)


class QueueTimeoutError(InfraError):
    """A job waited in its queue longer than the queue timeout and was cancelled (INFRA: a retry resubmits)."""

log = logging.getLogger(__name__)


def job_name(*parts: str, max_len: int = 63) -> str:
    """A deterministic backend-safe job name from (dag, run, task, try): the same task try, the same name."""
    raw = "-".join(parts)
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    digest = hashlib.sha1(raw.encode()).hexdigest()[:10]
    return f"{slug[: max_len - len(digest) - 1].strip('-')}-{digest}"


def read_heartbeats(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank's latest heartbeat in ``output_dir`` (a local folder or an fsspec URL such as s3://...)."""
    beats = []
    for path in storage.glob(output_dir, "heartbeat-rank*.json"):
        try:
            beats.append(storage.read_json(path))
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now (or gone): the next poll reads it
    return beats


def failure_messages(output_dir: str | Path | None) -> str:
    """What a failed job's ranks said why (their ``failure-rank<r>.json``), '' if none did or it cannot be read."""
    if not output_dir:
        return ""
    said = []
    try:
        for path in storage.glob(output_dir, "failure-rank*.json"):
            said.append(str(storage.read_json(path).get("message") or ""))
    except Exception:  # noqa: BLE001 - a courtesy: the exit code already says the class
        return ""
    return "; ".join(dict.fromkeys(m for m in said if m))[:1000]


class HeartbeatWatch:
    """Progress from the ranks' heartbeats; a stall is no change for ``stall_seconds``.

    The ``progress`` counters also move during the final evaluation and checkpointing, so a long
    evaluation is not a stall. The clock starts when the watch is made or :meth:`restart` ed (a running job
    that never writes a heartbeat stalls too).
    """

    def __init__(self, stall_seconds: float, clock: Any = time.monotonic) -> None:
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.last_progress = clock()
        self.last_steps: tuple[int, ...] = ()

    def restart(self) -> None:
        self.last_progress = self.clock()

    def observe(self, beats: list[dict[str, Any]]) -> bool:
        """Record the heartbeats; True if the job has stalled."""
        steps = tuple(int(b.get("progress", b.get("step", 0))) for b in beats)
        if steps != self.last_steps:
            self.last_steps, self.last_progress = steps, self.clock()
        return self.clock() - self.last_progress > self.stall_seconds

    def stall_message(self, what: str, job_id: str) -> str:
        return (
            f"{what} {job_id} made no progress for {self.stall_seconds:.0f}s (heartbeat steps "
            f"{list(self.last_steps)}); cancelled it — retrying from the last checkpoint"
        )


class JobWatch:
    """The queue clock and the stall clock of one job, fed with each status (and heartbeats while it runs).

    While the job is queued only the queue timeout applies (0: none), counted from the backend's own
    submission time when it reports one (so a restarted trigger keeps counting), else from the first look,
    and from the moment it went back to the queue after running. When the job runs, the stall clock starts.
    The start time (the backend's, else when the watch first saw it running) and the time spent queued are
    kept for the job history (:meth:`times`).
    """

    def __init__(
        self, stall_seconds: float, queue_timeout_seconds: float = 0.0, *, what: str = "job",
        clock: Any = time.monotonic, wall: Any = time.time,
    ) -> None:
        self.what = what
        self.heartbeats = HeartbeatWatch(stall_seconds, clock)
        self.queue_timeout_seconds = float(queue_timeout_seconds or 0.0)
        self.clock = clock
        self.wall = wall
        self.created_at: float | None = None
        self.started_at: float | None = None
        self.queued_s: float = 0.0  # every queued spell so far
        self._queued_since: float | None = None  # wall time the current queued spell began
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def observe(self, status: JobStatus) -> tuple[str, str] | None:
        """Record a status; ``(QUEUE_TIMEOUT, message)`` if the job has waited too long, else None."""
        now = self.wall()
        if self.created_at is None:
            self.created_at = status.created_at or now
        if status.state is JobState.RUNNING:
            if not self._running:
                started = status.started_at if status.started_at and not self.started_at else now
                self.started_at = self.started_at or started
                self.queued_s += max(0.0, started - (self._queued_since or self.created_at))
                self._queued_since = None
                self._running = True
                self.heartbeats.restart()  # the stall clock starts now, not at submission
            return None
        if status.state is JobState.PENDING:
            if self._running or self._queued_since is None:
                self._queued_since = self.created_at if not self._running and not self.started_at else now
            self._running = False
            waited = now - self._queued_since
            if self.queue_timeout_seconds and waited > self.queue_timeout_seconds:
                return QUEUE_TIMEOUT, waited_message(status, waited, self.queue_timeout_seconds, self.what)
        return None

    def stalled(self, beats: list[dict[str, Any]]) -> bool:
        """Record heartbeats of the running job; True if it has made no progress for the stall timeout."""
        return self._running and self.heartbeats.observe(beats)

    def times(self, status: JobStatus | None = None) -> dict[str, float | None]:
        """``created_at``, ``started_at`` (epoch s) and ``queued_s`` for the job history."""
        started = (status.started_at if status else None) or self.started_at
        created = (status.created_at if status else None) or self.created_at
        queued = self.queued_s if self.started_at else None
        if status is not None and status.queued_s is not None and queued is None:
            queued = status.queued_s
        return {"created_at": created, "started_at": started, "queued_s": queued}


def waited_message(status: JobStatus, waited: float, timeout: float, what: str = "job") -> str:
    return (
        f"{what} {status.job_id} waited {waited:.0f}s queued ({status.reason or status.state.value}) without "
        f"starting, longer than the queue timeout of {timeout:.0f}s (training.queue_timeout_seconds); cancelled "
        "it — no capacity for it yet: the retry submits it again (raise the timeout, or pick another instance type)"
    )


@dataclasses.dataclass(frozen=True)
class ShardMarkers:
    """Where an array job's shards leave their outputs: ``base`` (a local folder or URL) and one glob per output
    (``features/user_daily/shard-*/_SUCCESS``); a shard counts as built once it has every output. ``total``: shards
    of the step (those built by an earlier try count too)."""

    base: str
    patterns: tuple[str, ...]
    total: int

    def to_list(self) -> list[Any]:
        return [self.base, list(self.patterns), self.total]

    @classmethod
    def from_list(cls, data: Any) -> ShardMarkers | None:
        return cls(str(data[0]), tuple(str(p) for p in data[1]), int(data[2])) if data else None


class ShardCounter:
    """A line for the task log each time more of an array job's shards are built (:class:`ShardMarkers`)."""

    def __init__(self, markers: ShardMarkers | None) -> None:
        self.markers, self.built = markers, -1

    def line(self) -> str | None:
        """``3 of 8 shard(s) built`` when the count changed since the last call; None otherwise (or on a failed look:
        the next poll looks again)."""
        if self.markers is None:
            return None
        try:  # a shard's folder name (shard-00003), found under every output's pattern
            found = [{marker.rstrip("/").split("/")[-2] for marker in storage.glob(self.markers.base, pattern)}
                     for pattern in self.markers.patterns]
            built = len(set.intersection(*found)) if found else 0
        except Exception as err:  # noqa: BLE001 - progress is informative only: an object store's hiccup waits
            log.debug("could not count the built shards under %s: %s", self.markers.base, err)
            return None
        if built == self.built:
            return None
        self.built = built
        return f"{built} of {self.markers.total} shard(s) built"


def describe_beats(beats: list[dict[str, Any]]) -> str:
    """step/total, %, epoch, loss (none before the first step), examples/s of all ranks, ETA."""
    from training.runtime import progress_line

    return progress_line(beats)




def poll_delays(poll_seconds: float, first: float = 0.25) -> Iterator[float]:
    """The waits between status checks: ``first``, doubling up to ``poll_seconds`` (a job of seconds, such as a
    feature build step on the embedded default, is seen to end within a fraction of a second; a long one is
    checked every ``poll_seconds``)."""
    delay = min(first, poll_seconds)
    while True:
        yield delay
        delay = min(delay * 2, poll_seconds)


def raise_for_status(backend: Backend, status: JobStatus, *, what: str = "job") -> JobStatus:
    """Return a succeeded status; raise the failure class's typed error for a failed one."""
    if status.state is JobState.SUCCEEDED:
        return status
    if not status.state.terminal:
        raise InfraError(f"{what} {status.job_id} is still {status.state.value}: expected it to have ended")
    klass = status.failure_class or FailureClass.USER
    try:
        tail = backend.logs(status.job_id, tail=30)
    except Exception as err:  # noqa: BLE001 - the logs are a courtesy; the classification is what matters
        tail = f"(logs unavailable: {err})"
    raise ERROR_FOR_CLASS[klass](
        f"{what} {status.job_id} failed ({klass.value}): {status.reason} — {ADVICE[klass]}\nlast log lines:\n{tail}"
    )


def wait_for_job(
    backend: Backend,
    job_id: str,
    *,
    output_dir: str | Path | None = None,
    poll_seconds: float = 5.0,
    stall_seconds: float = 300.0,
    queue_timeout_seconds: float = 0.0,
    what: str = "job",
    shard_markers: ShardMarkers | None = None,
    sleep: Any = time.sleep,
) -> JobStatus:
    """Poll until the job ends; raise the failure class's error, or InfraError after a stall or a queue timeout.

    Heartbeats are watched only while the job runs (:class:`JobWatch`); a stall or a queue timeout cancels
    the job first, so a retry does not race it. The returned status carries the job's start and queue times.
    ``shard_markers``: an array job's shards, logged as they are built (:class:`ShardCounter`).
    """
    from services.job_history import Watching

    watch = JobWatch(stall_seconds, queue_timeout_seconds, what=what)
    watching = Watching(backend.name, job_id, None if output_dir is None else str(output_dir))
    delays = poll_delays(poll_seconds)
    last_log = 0.0
    was_running = False
    shards = ShardCounter(shard_markers)
    while True:
        status = backend.status(job_id)
        if status.state.terminal:
            if line := shards.line():  # the count at the end, however short the job was between polls
                log.info("%s %s: %s", what, job_id, line)
            break
        watching.tick()
        verdict = watch.observe(status)
        if verdict is not None:
            backend.cancel(job_id)
            raise QueueTimeoutError(verdict[1])
        if watch.running and not was_running:
            log.info("%s %s is running after %.0fs queued", what, job_id, watch.queued_s)
        was_running = watch.running
        if watch.running and (line := shards.line()):
            log.info("%s %s: %s", what, job_id, line)
        if output_dir is not None and watch.running:
            beats = read_heartbeats(output_dir)
            if beats and time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                log.info("%s %s: %s", what, job_id, describe_beats(beats))
            if watch.stalled(beats):
                backend.cancel(job_id)
                raise InfraError(watch.heartbeats.stall_message(what, job_id))
        sleep(next(delays))
    times = watch.times(status)
    status = dataclasses.replace(status, created_at=times["created_at"], started_at=times["started_at"])
    return raise_for_status(backend, status, what=what)
