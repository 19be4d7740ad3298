"""A job's lease: the task that watches a job renews it; the job checks it before it registers its model.

A task can die with its job still running (its runner SIGKILLed, a worker lost with no retry left). The job history's
reconcile cancels a job no task has watched for ``job_history.orphan_after_s``, but a shorter job reaches its end
first and would register a model version nobody decides on. The lease is a small file in the job's output folder
(beside RUN.json): every backend's job reaches it (a local path or s3://), unlike the job history database. A task
waiting for its job renews it (``services.job_history.Watching``, the operator polling or its trigger); a job whose
lease has not been renewed for ``lease_s`` (RUN.json, from ``job_history.lease_s``) does not register its model and
exits as INFRA (:class:`~core.failures.TaskGoneError`): a retry of the task submits a job that resumes from the last
checkpoint. A job without a lease file (started by hand, or by older code) does what it always did.

Clocks: the lease's age is the difference of two timestamps of the storage itself, the lease file's modification
time (mtime, S3's LastModified) and that of a probe file the job writes beside it when it checks, so neither the
watcher's clock nor the job's matters (a node whose clock is minutes off neither expires nor keeps a lease). The
writer's own time inside the file is for people only.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket

from core import storage
from core.failures import TaskGoneError

log = logging.getLogger(__name__)

LEASE_FILE = "LEASE.json"
PROBE_FILE = "LEASE.checked"  # written by the job when it checks: its modification time is the storage's "now"


def lease_path(output_dir: storage.Location) -> str:
    return storage.join(output_dir, LEASE_FILE)


def renew(output_dir: storage.Location, job_id: str = "") -> bool:
    """Write (or rewrite) the job's lease; never raises: a failed renewal is logged and returns False."""
    try:
        storage.write_json(lease_path(output_dir), {
            "job_id": job_id, "renewed_by": f"{socket.gethostname()}:{os.getpid()}",
            "renewed_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),  # for people: the age uses mtimes
        })
        return True
    except Exception as err:  # noqa: BLE001 - a watcher must never fail its task over its lease
        log.warning("could not renew the lease of job %s in %s: %s", job_id or "?", output_dir, err)
        return False


def age_s(output_dir: storage.Location) -> float | None:
    """Seconds since the lease was last renewed, by the storage's clock; None when the job has no lease."""
    probe = storage.join(output_dir, PROBE_FILE)
    storage.write_text(probe, dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    # The probe first: a renewal between the two reads makes the age 0, never too old.
    now, renewed = storage.modified(probe), storage.modified(lease_path(output_dir))
    if renewed is None or now is None:
        return None
    return max(0.0, now - renewed)


def check(output_dir: storage.Location, lease_s: float) -> None:
    """Raise :class:`~core.failures.TaskGoneError` if the lease has not been renewed for ``lease_s`` seconds.

    Nothing when ``lease_s`` is 0 (disabled), when the job has no lease, or when the storage cannot say (logged: the
    lease guards against orphans, it must not fail a job that is watched)."""
    if not lease_s:
        return
    try:
        age = age_s(output_dir)
    except Exception as err:  # noqa: BLE001 - see above
        log.warning("could not check the lease in %s (going on as if renewed): %s", output_dir, err)
        return
    if age is not None and age > lease_s:
        raise TaskGoneError(
            f"no task has watched this job for {age:.0f} s (lease {lease_s:.0f} s, {lease_path(output_dir)}): its task "
            "is gone; not registering the model; a retry of the task submits a job that resumes from the last "
            "checkpoint")
