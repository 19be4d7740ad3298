"""Watch a submitted job to its end: progress from heartbeats, stall detection, typed failure."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from core import storage
from core.failures import ADVICE, ERROR_FOR_CLASS, FailureClass, InfraError
from operators.backends.base import Backend, JobState, JobStatus

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


class HeartbeatWatch:
    """Progress from the ranks' heartbeats; a stall is no change for ``stall_seconds``.

    The ``progress`` counters also move during the final evaluation and checkpointing, so a long
    evaluation is not a stall. The clock starts when the watch is made (a job that never writes a
    heartbeat stalls too).
    """

    def __init__(self, stall_seconds: float, clock: Any = time.monotonic) -> None:
        self.stall_seconds = stall_seconds
        self.clock = clock
        self.last_progress = clock()
        self.last_steps: tuple[int, ...] = ()

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


def describe_beats(beats: list[dict[str, Any]]) -> str:
    b = beats[0]
    return (
        f"step {b.get('step')} epoch {b.get('epoch')} loss {float(b.get('loss', float('nan'))):.4f}, "
        f"{float(b.get('examples_per_s', 0.0)):.0f} examples/s per rank ({len(beats)} ranks reporting)"
    )




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
    what: str = "job",
) -> JobStatus:
    """Poll until the job ends; raise the failure class's error, or InfraError after a stall.

    A stall (see :class:`HeartbeatWatch`) cancels the job first, so a retry does not race it.
    """
    watch = HeartbeatWatch(stall_seconds)
    last_log = 0.0
    while True:
        status = backend.status(job_id)
        if status.state.terminal:
            break
        if output_dir is not None:
            beats = read_heartbeats(output_dir)
            if beats and time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                log.info("%s %s: %s", what, job_id, describe_beats(beats))
            if watch.observe(beats):
                backend.cancel(job_id)
                raise InfraError(watch.stall_message(what, job_id))
        time.sleep(poll_seconds)
    return raise_for_status(backend, status, what=what)
