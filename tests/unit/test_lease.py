"""A job's lease (``core.lease``, issue 37 item 2): the watcher renews it, the job checks it before it registers.

On a local folder and on ``memory://`` (an fsspec filesystem, the same code as ``s3://``); against a real S3 API:
tests/integration/test_lease_s3.py. The job's side end to end: tests/integration/test_orphan_lease.py."""

from __future__ import annotations

import datetime as dt
import logging
import os
import uuid

import pytest

from core import lease, storage
from core.config import PlatformConfig
from core.failures import ExitCode, FailureClass, TaskGoneError, exit_code_for

pytestmark = pytest.mark.unit


@pytest.fixture(params=["local", "memory"])
def output_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs" / "job-1")
    return f"memory://lease-{uuid.uuid4().hex[:8]}/runs/job-1"


def age_lease(output_dir: str, seconds: float) -> None:
    """Make the lease ``seconds`` older, as the storage stamps it (its mtime or LastModified)."""
    path = lease.lease_path(output_dir)
    if not storage.is_remote(path):
        stamp = os.stat(path).st_mtime - seconds
        os.utime(path, (stamp, stamp))
        return
    fs, key = storage.filesystem(path)
    fs.store[key].modified -= dt.timedelta(seconds=seconds)


def test_a_renewed_lease_is_young_and_lets_the_job_register(output_dir):
    assert lease.renew(output_dir, "job-1")
    assert storage.read_json(lease.lease_path(output_dir))["job_id"] == "job-1"
    age = lease.age_s(output_dir)
    assert age is not None and age < 5
    lease.check(output_dir, 300)  # nothing raised


def test_a_lease_not_renewed_for_lease_s_stops_the_job_as_infra(output_dir):
    lease.renew(output_dir, "job-1")
    age_lease(output_dir, 400)
    with pytest.raises(TaskGoneError, match=r"no task has watched this job for 4\d\d s .*its task is gone; not "
                                            r"registering") as err:
        lease.check(output_dir, 300)
    # INFRA: the retry's new job resumes from the checkpoint the stopped one left.
    assert err.value.failure_class is FailureClass.INFRA and exit_code_for(err.value) is ExitCode.INFRA
    lease.check(output_dir, 600)  # a longer lease has not expired yet
    lease.check(output_dir, 0)  # 0: never checked
    lease.renew(output_dir, "job-1")  # a retry that reattaches renews it: the adopted job goes on
    lease.check(output_dir, 300)


def test_a_job_without_a_lease_behaves_as_before(output_dir):
    """Started by hand, or by code from before the lease: nothing to check."""
    assert lease.age_s(output_dir) is None
    lease.check(output_dir, 1)


def test_renewal_and_check_never_fail_on_a_storage_error(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("storage unreachable")

    monkeypatch.setattr(storage.paths, "write_bytes", broken)  # under write_json and write_text
    with caplog.at_level(logging.WARNING, logger="core.lease"):
        assert lease.renew("/nonexistent/runs/job-1", "job-1") is False
        lease.check("/nonexistent/runs/job-1", 300)
    assert "could not renew the lease" in caplog.text and "could not check the lease" in caplog.text


def test_lease_setting_is_checked_against_the_poll():
    assert PlatformConfig().job_history.lease_s == 300
    assert PlatformConfig.model_validate({"job_history": {"lease_s": 0}}).job_history.lease_s == 0
    with pytest.raises(ValueError, match="lease_s=20 must be at least 3 x training.poll_seconds"):
        PlatformConfig.model_validate({"job_history": {"lease_s": 20}})


def test_a_watcher_renews_the_lease_at_once_then_within_each_lease(tmp_path, monkeypatch):
    from services import job_history

    assert job_history.lease_every_s(300) == job_history.WATCH_EVERY_S
    assert job_history.lease_every_s(8) == 2 and job_history.lease_every_s(0) == job_history.WATCH_EVERY_S
    monkeypatch.setattr(job_history, "note", lambda *a, **k: None)  # no job history here
    renewals: list[str] = []
    monkeypatch.setattr(lease, "renew", lambda output_dir, job_id="": renewals.append(job_id) or True)
    clock = [1000.0]
    monkeypatch.setattr(job_history.time, "monotonic", lambda: clock[0])
    watching = job_history.Watching("local", "job-1", str(tmp_path))
    watching.tick()
    assert renewals == ["job-1"]  # a reattaching try or a restarted trigger renews before anything else
    clock[0] += watching.lease_every - 1
    watching.tick()
    assert renewals == ["job-1"]
    clock[0] += 1
    watching.tick()
    assert renewals == ["job-1", "job-1"]
    job_history.Watching("local", "job-2").tick()  # no output folder (a feature build step): no lease
    assert renewals == ["job-1", "job-1"]
