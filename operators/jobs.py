"""Watch a submitted job to its end: progress from heartbeats, stall detection, typed failure."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from operators.backends.base import Backend, JobState, JobStatus
from operators.errors import ERROR_FOR_CLASS, InfraFailure
from training.failures import FailureClass

log = logging.getLogger(__name__)


def job_name(*parts: str, max_len: int = 63) -> str:
    """A deterministic backend-safe job name from (dag, run, task, try): the same task try, the same name."""
    raw = "-".join(parts)
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    digest = hashlib.sha1(raw.encode()).hexdigest()[:10]
    return f"{slug[: max_len - len(digest) - 1].strip('-')}-{digest}"


def read_heartbeats(output_dir: Path) -> list[dict[str, Any]]:
    beats = []
    for path in sorted(output_dir.glob("heartbeat-rank*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now: next poll reads it
    return beats


def wait_for_job(
    backend: Backend,
    job_id: str,
    *,
    output_dir: Path | None = None,
    poll_seconds: float = 5.0,
    stall_seconds: float = 300.0,
    what: str = "job",
) -> JobStatus:
    """Poll until the job ends; raise the failure class's error, or InfraFailure after a stall.

    A stall is no heartbeat progress (the ranks' ``progress`` counters, which also move during the final
    evaluation, stand still) for ``stall_seconds`` while the job runs; the job is cancelled first so a
    retry does not race it.
    """
    last_progress = time.monotonic()
    last_steps: tuple[int, ...] = ()
    last_log = 0.0
    while True:
        status = backend.status(job_id)
        if status.state.terminal:
            break
        if output_dir is not None:
            beats = read_heartbeats(output_dir)
            steps = tuple(int(b.get("progress", b.get("step", 0))) for b in beats)
            if steps != last_steps:
                last_steps, last_progress = steps, time.monotonic()
            if beats and time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                b = beats[0]
                log.info(
                    "%s %s: step %s epoch %s loss %.4f, %.0f examples/s per rank (%d ranks reporting)",
                    what, job_id, b.get("step"), b.get("epoch"), float(b.get("loss", float("nan"))),
                    float(b.get("examples_per_s", 0.0)), len(beats),
                )
        if time.monotonic() - last_progress > stall_seconds:
            backend.cancel(job_id)
            raise InfraFailure(
                f"{what} {job_id} made no progress for {stall_seconds:.0f}s (heartbeat steps {list(last_steps)}); "
                "cancelled it — retrying from the last checkpoint"
            )
        time.sleep(poll_seconds)

    if status.state is JobState.SUCCEEDED:
        return status
    klass = status.failure_class or FailureClass.USER
    tail = backend.logs(job_id, tail=30)
    advice = {
        FailureClass.INFRA: "retrying from the last checkpoint",
        FailureClass.USER: "fix the model code or the run's params, then clear the task",
        FailureClass.DATA: "fix or rebuild the input partitions, then clear the task",
        FailureClass.OOM: "lower batch_size or give each node more memory",
    }[klass]
    raise ERROR_FOR_CLASS[klass](
        f"{what} {job_id} failed ({klass.value}): {status.reason} — {advice}\nlast log lines:\n{tail}"
    )
