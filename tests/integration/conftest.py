"""Services the integration tests start for themselves."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A moto server (every AWS API moto has: S3, Batch, CloudWatch Logs, IAM) on a free local port: its URL.

    One per test session; each test uses its own bucket or queue names and removes what it created."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def aws_environment(endpoint: str, scratch: Path) -> dict[str, str]:
    """The AWS variables that lead boto3, s3fs and the jobs (subprocesses inherit them) to a test server, with
    no profile, config or credentials file of the machine in the way."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(scratch / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "no-aws-credentials"),
    }


@contextmanager
def s3_environment(endpoint: str, scratch: Path) -> Iterator[None]:
    """This process's environment pointed at the S3 server at ``endpoint`` (restored afterwards).

    s3fs filesystems are cached per process by their arguments, not by the environment, and each keeps the endpoint
    its client was made with: one made for an earlier test's server would serve this test (and one made for this
    test's server, later tests). None of them is kept on either side. Every moto server of a process serves the same
    buckets, so a request sent to the wrong server would still succeed: only a server's own record would tell."""
    import s3fs

    with pytest.MonkeyPatch.context() as patch:
        for name, value in aws_environment(endpoint, scratch).items():
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def s3_bucket(endpoint: str, scratch: Path, bucket: str) -> Iterator[Any]:
    """:func:`s3_environment` and a fresh bucket on that server, removed with everything in it afterwards: the
    bucket's s3fs filesystem."""
    import boto3
    import fsspec

    with s3_environment(endpoint, scratch):
        boto3.client("s3").create_bucket(Bucket=bucket)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        try:
            yield fs
        finally:
            fs.rm(bucket, recursive=True)
