"""The AWS Batch backend against a moto server started here and reached over HTTP through the Amazon
provider's hooks (an Airflow connection whose extra points endpoint_url at the server).

Two queues: a FIFO one and a fair-share one (with a scheduling policy). AWS refuses ``shareIdentifier`` on a
FIFO queue and requires it on a fair-share queue; moto enforces neither, so the test client checks every
``SubmitJob`` it sends the way AWS would.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from core.config import BatchConfig, PlatformConfig, TeamConfig
from operators.backends import JobSpec, JobState, get_backend

TEAMS = {"ranking": TeamConfig(queue="ranking", share="ranking", priority=50),  # scheduling: auto (asked)
         "ads": TeamConfig(queue="ads-fair", share="ads", priority=70, instance_type="p5.48xlarge")}
FAIR_SHARE_QUEUES = {"ads-fair"}


@pytest.fixture(scope="module")
def moto_url(moto_server):
    url = moto_server
    # No Docker here: moto's "simple" Batch marks a submitted job as finished instead of running it.
    request = urllib.request.Request(f"{url}/moto-api/config", data=json.dumps({"batch": {"use_docker": False}}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request).read()
    conn = {"conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"endpoint_url": url, "region_name": "us-east-1"}}
    saved = {k: os.environ.get(k) for k in ("AIRFLOW_CONN_AWS_DEFAULT", "AWS_DEFAULT_REGION")}
    os.environ.update({"AIRFLOW_CONN_AWS_DEFAULT": json.dumps(conn), "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def batch(moto_url):
    """A compute environment and the team's queue, created through boto3 against the server."""
    import boto3

    kw = {"endpoint_url": moto_url, "region_name": "us-east-1", "aws_access_key_id": "testing",
          "aws_secret_access_key": "testing"}
    iam = boto3.client("iam", **kw)
    role = iam.create_role(RoleName="batch-service", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    client = boto3.client("batch", **kw)
    env = client.create_compute_environment(computeEnvironmentName="pinflow-gpu", type="UNMANAGED", state="ENABLED",
                                            serviceRole=role)
    order = [{"order": 1, "computeEnvironment": env["computeEnvironmentArn"]}]
    client.create_job_queue(jobQueueName="ranking", state="ENABLED", priority=1, computeEnvironmentOrder=order)
    policy = client.create_scheduling_policy(name="pinflow-teams", fairsharePolicy={
        "shareDecaySeconds": 3600, "computeReservation": 10, "shareDistribution": [
            {"shareIdentifier": "ads", "weightFactor": 1.0}, {"shareIdentifier": "ranking", "weightFactor": 1.0}]})
    client.create_job_queue(jobQueueName="ads-fair", state="ENABLED", priority=1, computeEnvironmentOrder=order,
                            schedulingPolicyArn=policy["arn"])
    backend = get_backend("batch", PlatformConfig(home="/tmp", teams=TEAMS, batch=BatchConfig(region_name="us-east-1")))
    submitted: list[dict] = []

    def as_aws_would(params, **_):
        """AWS SubmitJob: a share identifier exactly when the queue has a fair-share scheduling policy."""
        queue = params["jobQueue"].rsplit("/", 1)[-1]
        fair, has_share = queue in FAIR_SHARE_QUEUES, "shareIdentifier" in params
        if fair != has_share:
            raise AssertionError(f"AWS would reject this SubmitJob to {queue} ({'fair share' if fair else 'FIFO'}): "
                                 f"shareIdentifier {'missing' if fair else 'given'}")
        submitted.append(dict(params))

    backend.hook.client.meta.events.register("provide-client-params.batch.SubmitJob", as_aws_would)
    return backend, client, boto3.client("logs", **kw), submitted


def spec(name, **change):
    return JobSpec(**{"name": name, "command": ["-m", "training.train", "--config", "s3://b/RUN.json"], "team": "ranking",
                      "image": "pinflow-training:1", "distributed": True, "nodes": 2, "procs_per_node": 1, **change})


@pytest.mark.integration
def test_submit_find_status_and_one_definition_per_content(batch):
    backend, client, _, _ = batch
    backend.ping()
    job_id = backend.submit(spec("train-a-try1"))
    assert backend.find("train-a-try1") == job_id
    # The same name again (a restarted worker) finds the job instead of submitting another.
    assert backend.submit(spec("train-a-try1")) == job_id
    jobs = client.list_jobs(jobQueue="ranking", filters=[{"name": "JOB_NAME", "values": ["train-a-try1"]}])
    assert len(jobs["jobSummaryList"]) == 1
    # Another job with the same image and resources reuses the definition registered for the first.
    other = backend.submit(spec("train-b-try1"))
    assert other != job_id
    name = backend.dry_run(spec("x"))["job_definition"]["jobDefinitionName"]
    assert len(client.describe_job_definitions(jobDefinitionName=name)["jobDefinitions"]) == 1
    described = client.describe_jobs(jobs=[job_id])["jobs"][0]
    assert described["jobDefinition"].split("/")[-1].startswith(name)
    assert described["nodeProperties"]["numNodes"] == 2
    assert described["tags"]["pinflow:team"] == "ranking"
    deadline = time.monotonic() + 30
    while not (status := backend.status(job_id)).state.terminal:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status.state is JobState.SUCCEEDED
    assert status.created_at and status.started_at and status.queued_s is not None  # Batch's own times
    assert backend.find("never-submitted") is None


@pytest.mark.integration
def test_fair_share_fields_only_on_the_fair_share_queue(batch):
    """The queues' policies are read with describe_job_queues (scheduling: auto); each SubmitJob is as AWS wants."""
    backend, client, _, submitted = batch
    fifo_id = backend.submit(spec("train-fifo-try1"))
    fair_id = backend.submit(spec("train-fair-try1", team="ads", image=""))
    sent = {p["jobName"]: p for p in submitted}
    assert "shareIdentifier" not in sent["train-fifo-try1"] and "schedulingPriorityOverride" not in sent["train-fifo-try1"]
    assert (sent["train-fair-try1"]["shareIdentifier"], sent["train-fair-try1"]["schedulingPriorityOverride"]) == ("ads", 70)
    assert backend._fair_share == {"ranking": False, "ads-fair": True}
    fair = client.describe_jobs(jobs=[fair_id])["jobs"][0]
    # The p5 job definition as registered: the whole node, EFA devices, the reference's ulimits.
    container = fair["nodeProperties"]["nodeRangeProperties"][0]["container"]
    assert container["instanceType"] == "p5.48xlarge" and len(container["linuxParameters"]["devices"]) == 32
    assert {u["name"]: u["hardLimit"] for u in container["ulimits"]} == {"memlock": -1, "stack": 67108864,
                                                                         "nofile": 1024000}
    assert fifo_id != fair_id


@pytest.mark.integration
def test_terminate_and_logs(batch):
    backend, client, logs, _ = batch
    job_id = backend.submit(spec("train-c-try1", distributed=False, nodes=1))
    backend.cancel(job_id)
    described = client.describe_jobs(jobs=[job_id])["jobs"][0]
    assert described["statusReason"] == "Terminated by pinflow"
    stream = described["container"]["logStreamName"]
    try:
        logs.create_log_group(logGroupName="/aws/batch/job")
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    try:
        logs.create_log_stream(logGroupName="/aws/batch/job", logStreamName=stream)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    now = int(time.time() * 1000)
    logs.put_log_events(logGroupName="/aws/batch/job", logStreamName=stream, logEvents=[
        {"timestamp": now + i, "message": f"step {i}"} for i in range(5)])
    text = backend.logs(job_id, tail=2)
    assert stream in text and "step 3\nstep 4" in text and "step 2" not in text
