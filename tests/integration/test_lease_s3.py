"""A job's lease (``core.lease``) on an ``s3://`` output folder: a moto S3 server over HTTP. Its age is the difference
of two LastModified stamps (the lease's and the job's probe's), the server's own clock."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import s3_bucket

from core import lease
from core.failures import TaskGoneError

pytestmark = pytest.mark.integration

BUCKET = "pinflow-lease-test"


def test_lease_on_s3_renew_expire_missing_disabled(moto_server: str, tmp_path: Path) -> None:
    with s3_bucket(moto_server, tmp_path, BUCKET):
        run = f"s3://{BUCKET}/pinflow/runs/job-1"
        assert lease.age_s(run) is None  # no lease: a job started by hand checks nothing
        lease.check(run, 1)
        assert lease.renew(run, "job-1")
        age = lease.age_s(run)
        assert age is not None and age < 5
        lease.check(run, 300)
        time.sleep(2.2)  # LastModified counts whole seconds
        with pytest.raises(TaskGoneError, match="its task is gone"):
            lease.check(run, 1)
        lease.check(run, 0)  # disabled
        assert lease.renew(run, "job-1")  # a reattaching try renews it: the job goes on
        lease.check(run, 5)
