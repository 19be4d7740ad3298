"""The AWS Batch backend's request (a pure dry run, asserted whole) and its classifier on recorded responses.

The reference for the request is AWS's own multi-node template (aws-samples/awsome-distributed-training,
1.architectures/3.aws-batch/0.aws-batch-distributed-training-p5.yaml): see ``test_p5_request_matches_the_reference``.
"""

from __future__ import annotations

import pytest

from core.config import BatchConfig, PlatformConfig, TeamConfig
from core.failures import FailureClass
from operators.backends import JobSpec, JobState, get_backend
from operators.backends.batch import RETRY_ON_EXIT, BatchBackend, classify_job
from operators.backends.resources import Catalog

TEAMS = {"ranking": TeamConfig(queue="ranking-p5", share="ranking", priority=50, instance_type="p5.48xlarge",
                               scheduling="fair_share"),
         "search": TeamConfig(queue="search-fifo", share="search", priority=10, instance_type="p5.48xlarge",
                              scheduling="fifo"),
         "ads": TeamConfig(queue="ads", share="ads", instance_type="p5.48xlarge")}  # scheduling: auto
CATALOG = Catalog.from_config(PlatformConfig(teams=TEAMS, images={"gpu": "123.dkr.ecr.us-east-1.amazonaws.com/pinflow-training:1.2"}))
NAME = "train-abc-try1-0123456789"
UVERBS = [{"hostPath": f"/dev/infiniband/uverbs{i}", "containerPath": f"/dev/infiniband/uverbs{i}",
           "permissions": ["READ", "WRITE", "MKNOD"]} for i in range(32)]


def spec(**change):
    """2 nodes x 8 GPUs on the team's p5.48xlarge, as the training operator sends it (no resources of its own)."""
    base = dict(name=NAME, command=["-m", "training.train", "--config", "s3://b/runs/x/RUN.json"],
                team="ranking", distributed=True, nodes=2, procs_per_node=8, env={"OMP_NUM_THREADS": "1"},
                timeout_s=7200, checkpoint_dir="s3://b/models/x/checkpoints", preflight=True)
    return JobSpec(**{**base, **change})


def backend(**opts):
    return BatchBackend(BatchConfig(**{"job_role_arn": "arn:aws:iam::123:role/pinflow", **opts}), TEAMS, CATALOG)


P5_CONTAINER = {
    "image": "123.dkr.ecr.us-east-1.amazonaws.com/pinflow-training:1.2",
    "command": ["python", "-m", "training.launch", "--help"],
    # The whole node: 192 vCPUs, 8 GPUs, 2048 GiB x 0.96 (the reference asks for 1049000 MiB, half the node).
    "resourceRequirements": [
        {"type": "VCPU", "value": "192"}, {"type": "MEMORY", "value": "2013265"}, {"type": "GPU", "value": "8"},
    ],
    "linuxParameters": {"initProcessEnabled": True, "sharedMemorySize": 49152, "devices": UVERBS},
    "ulimits": [
        {"name": "memlock", "softLimit": -1, "hardLimit": -1},
        {"name": "stack", "softLimit": 67108864, "hardLimit": 67108864},
        {"name": "nofile", "softLimit": 1024000, "hardLimit": 1024000},
    ],
    "logConfiguration": {"logDriver": "awslogs", "options": {"awslogs-group": "/aws/batch/job"}},
    "environment": [
        {"name": "FI_EFA_FORK_SAFE", "value": "1"}, {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
        {"name": "FI_PROVIDER", "value": "efa"}, {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker,ecs"},
    ],
    "instanceType": "p5.48xlarge",
    "jobRoleArn": "arn:aws:iam::123:role/pinflow",
}


@pytest.mark.unit
def test_dry_run_of_a_2_node_8_gpu_p5_job_is_the_whole_request():
    request = backend().dry_run(spec())
    definition = request["job_definition"]
    name = definition.pop("jobDefinitionName")
    assert name.startswith("pinflow-ranking-") and len(name) == len("pinflow-ranking-") + 12
    assert definition == {
        "platformCapabilities": ["EC2"],
        "retryStrategy": {"attempts": 3, "evaluateOnExit": RETRY_ON_EXIT},
        "propagateTags": True,
        "type": "multinode",
        "nodeProperties": {"numNodes": 2, "mainNode": 0,
                           "nodeRangeProperties": [{"targetNodes": "0:", "container": P5_CONTAINER}]},
    }
    assert request["submit"] == {
        "jobName": NAME,
        "jobQueue": "ranking-p5",
        "jobDefinition": name,
        "shareIdentifier": "ranking",  # a fair-share queue: the team's share and priority
        "schedulingPriorityOverride": 50,
        "timeout": {"attemptDurationSeconds": 7200},
        "tags": {"pinflow:team": "ranking", "pinflow:job": NAME, "pinflow:instance-type": "p5.48xlarge"},
        "propagateTags": True,
        "nodeOverrides": {
            "numNodes": 2,
            "nodePropertyOverrides": [{
                "targetNodes": "0:",
                "containerOverrides": {
                    "command": ["python", "-m", "training.launch", "--nproc-per-node=8", f"--rdzv-id={NAME}",
                                "--preflight", "--", "-m", "training.train", "--config", "s3://b/runs/x/RUN.json"],
                    "environment": [
                        {"name": "OMP_NUM_THREADS", "value": "1"},
                        {"name": "PINFLOW_CHECKPOINT_DIR", "value": "s3://b/models/x/checkpoints"},
                        {"name": "PINFLOW_RDZV_PORT", "value": "29400"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
                    ],
                },
            }],
        },
    }


@pytest.mark.unit
def test_p5_request_matches_the_reference():
    """Field by field against AWS's p5 job definition (values copied from the reference template)."""
    container = backend().dry_run(spec())["job_definition"]["nodeProperties"]["nodeRangeProperties"][0]["container"]
    reference = {
        "InstanceType": "p5.48xlarge",
        "Ulimits": [{"Name": "memlock", "HardLimit": -1, "SoftLimit": -1},
                    {"Name": "stack", "HardLimit": 67108864, "SoftLimit": 67108864},
                    {"Name": "nofile", "HardLimit": 1024000, "SoftLimit": 1024000}],
        "SharedMemorySize": 49152,
        "Devices": [{"HostPath": f"/dev/infiniband/uverbs{i}", "ContainerPath": f"/dev/infiniband/uverbs{i}",
                     "Permissions": ["READ", "WRITE", "MKNOD"]} for i in range(32)],
        "Env": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"},
        "VCPU": "192", "GPU": "8",
    }
    assert container["instanceType"] == reference["InstanceType"]
    assert container["ulimits"] == [{"name": u["Name"], "softLimit": u["SoftLimit"], "hardLimit": u["HardLimit"]}
                                    for u in reference["Ulimits"]]
    assert container["linuxParameters"]["sharedMemorySize"] == reference["SharedMemorySize"]
    assert container["linuxParameters"]["devices"] == [
        {"hostPath": d["HostPath"], "containerPath": d["ContainerPath"], "permissions": d["Permissions"]}
        for d in reference["Devices"]]
    env = {e["name"]: e["value"] for e in container["environment"]}
    assert {k: env[k] for k in reference["Env"]} == reference["Env"] and "NCCL_PROTO" not in env
    resources = {r["type"]: r["value"] for r in container["resourceRequirements"]}
    assert (resources["VCPU"], resources["GPU"]) == (reference["VCPU"], reference["GPU"])
    # Not the reference's 1049000 MiB: the node's memory less the 4 % tax, still below what ECS registers.
    assert int(resources["MEMORY"]) == int(2048 * 1024 * 0.96)


@pytest.mark.unit
def test_fair_share_fields_only_for_a_fair_share_queue():
    fifo = backend().dry_run(spec(team="search"))["submit"]
    assert fifo["jobQueue"] == "search-fifo"
    assert "shareIdentifier" not in fifo and "schedulingPriorityOverride" not in fifo
    # scheduling: auto: the pure dry run leaves them out until AWS has been asked (submit asks, once per queue).
    assert "shareIdentifier" not in backend().dry_run(spec(team="ads"))["submit"]
    asked = backend().dry_run(spec(team="ads"), fair_share=True)["submit"]
    assert (asked["shareIdentifier"], asked["schedulingPriorityOverride"]) == ("ads", 50)


@pytest.mark.unit
def test_fair_share_is_read_from_the_queue_once_when_not_configured():
    class Client:
        calls = 0

        def describe_job_queues(self, jobQueues):
            Client.calls += 1
            return {"jobQueues": [{"jobQueueName": jobQueues[0], "schedulingPolicyArn": "arn:aws:batch:sp/fair"}]}

    class Hook:
        client = Client()

    b = backend()
    b._hook = Hook()
    assert b.fair_share("ads") is True and b.fair_share("ads") is True and Client.calls == 1
    assert b.fair_share("search") is False and b.fair_share("ranking") is True and Client.calls == 1


@pytest.mark.unit
def test_a_scoring_job_is_a_container_job_without_node_properties():
    request = backend().dry_run(spec(distributed=False, nodes=1, procs_per_node=1, team="search",
                                     instance_type="m5.2xlarge", cpus_per_node=2, memory_gb_per_node=8))
    container = request["job_definition"]["containerProperties"]
    assert request["job_definition"]["type"] == "container" and "instanceType" not in container
    assert container["resourceRequirements"] == [{"type": "VCPU", "value": "2"}, {"type": "MEMORY", "value": "8192"}]
    assert container["linuxParameters"] == {"initProcessEnabled": True, "sharedMemorySize": 2048}
    assert "environment" not in container
    assert container["image"] == "pinflow-training-cpu:latest"


@pytest.mark.unit
def test_definition_name_follows_content_only():
    b = backend()
    same = b.dry_run(spec(name="other-job", command=["-m", "x", "--config", "c"]))["job_definition"]["jobDefinitionName"]
    assert same == b.dry_run(spec())["job_definition"]["jobDefinitionName"]
    assert b.dry_run(spec(image="pinflow-training:1.3"))["job_definition"]["jobDefinitionName"] != same


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"team": "nope"}, "team 'nope' is not under teams:"),
        ({"gpus_per_node": 16, "procs_per_node": 16}, "a p5.48xlarge node has 8"),
        ({"procs_per_node": 9}, "procs_per_node=9 > gpus_per_node=8"),
        ({"image": "Not An Image"}, "training.image"),
        ({"instance_type": "p9.huge"}, "not under instance_types:"),
    ],
)
def test_spec_checked_against_config_naming_the_setting(change, says):
    with pytest.raises(ValueError) as err:
        backend().dry_run(spec(**change))
    assert says in str(err.value)


@pytest.mark.unit
def test_get_backend_builds_it_from_config():
    b = get_backend("batch", PlatformConfig(home="/tmp", teams=TEAMS, batch=BatchConfig(region_name="eu-west-1")))
    assert isinstance(b, BatchBackend) and b.options.region_name == "eu-west-1"
    assert b.catalog.default_instance_type == "m5.2xlarge"
    assert "eu-west-1.console.aws.amazon.com/batch" in b.console_url("abc")


# Recorded describe_jobs entries (trimmed) of outcomes a moto server cannot produce.
SPOT_LOSS = {
    "jobId": "j1", "status": "FAILED", "statusReason": "Host EC2 (instance i-0abc) terminated.",
    "nodeProperties": {"numNodes": 2},
}
NODE_FAILED_PARENT = {"jobId": "j2", "status": "FAILED", "statusReason": "Essential container in task exited",
                      "nodeProperties": {"numNodes": 2}}
NODE_0_NAN = {"jobId": "j2#0", "status": "FAILED", "nodeDetails": {"nodeIndex": 0, "isMainNode": True},
              "container": {"exitCode": 76, "reason": ""}, "statusReason": "Essential container in task exited"}
NODE_1_PEER_GONE = {"jobId": "j2#1", "status": "FAILED", "nodeDetails": {"nodeIndex": 1},
                    "container": {"exitCode": 75}, "statusReason": "Essential container in task exited"}
NODE_1_SPOT = {"jobId": "j3#1", "status": "FAILED", "nodeDetails": {"nodeIndex": 1},
               "statusReason": "Host EC2 (instance i-0def) terminated.", "container": {}}
OOM = {"jobId": "j4", "status": "FAILED", "statusReason": "Essential container in task exited",
       "container": {"exitCode": 137, "reason": "OutOfMemoryError: Container killed due to memory usage"}}
TIMEOUT = {"jobId": "j5", "status": "FAILED", "statusReason": "Job attempt duration exceeded timeout"}
# A container stopped by a terminate (or a timeout) exits 137 (SIGKILL after the stop timeout): not an OOM.
KILLED = {"jobId": "j6", "status": "FAILED", "statusReason": "Terminated by pinflow",
          "container": {"exitCode": 137}}
# 137 the job chose itself (torch.OutOfMemoryError: core.failures.ExitCode.OOM).
CHOSE_OOM = {"jobId": "j7", "status": "FAILED", "statusReason": "Essential container in task exited",
             "container": {"exitCode": 137}}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("job", "nodes", "klass", "says"),
    [
        (SPOT_LOSS, [], FailureClass.INFRA, "Host EC2"),
        (NODE_FAILED_PARENT, [NODE_0_NAN, NODE_1_PEER_GONE], FailureClass.USER, "node 0 exited with code 76"),
        (NODE_FAILED_PARENT | {"jobId": "j3"}, [NODE_0_NAN, NODE_1_SPOT], FailureClass.INFRA, "node 1: Host EC2"),
        (OOM, [], FailureClass.OOM, "OutOfMemoryError"),
        (TIMEOUT, [], FailureClass.INFRA, "timeout"),
        (KILLED, [], FailureClass.INFRA, "killed (exit 137, SIGKILL) when stopped"),
        (CHOSE_OOM, [], FailureClass.OOM, "exited with code 137"),
    ],
)
def test_classifier_on_recorded_failures(job, nodes, klass, says):
    status = classify_job(job, nodes)
    assert status.state is JobState.FAILED and status.failure_class is klass, status
    assert says in status.reason and f"AWS Batch job ({job['jobId']})" in status.reason


@pytest.mark.unit
@pytest.mark.parametrize(("raw", "state"), [("SUBMITTED", JobState.PENDING), ("RUNNABLE", JobState.PENDING),
                                            ("RUNNING", JobState.RUNNING), ("SUCCEEDED", JobState.SUCCEEDED)])
def test_classifier_states(raw, state):
    assert classify_job({"jobId": "j", "status": raw}).state is state


@pytest.mark.unit
def test_batch_times_give_the_queue_wait():
    queued = classify_job({"jobId": "j", "status": "RUNNABLE", "createdAt": 1_000_000})
    assert (queued.state, queued.reason, queued.created_at, queued.started_at) == (JobState.PENDING, "RUNNABLE", 1000.0,
                                                                                   None)
    running = classify_job({"jobId": "j", "status": "RUNNING", "createdAt": 1_000_000, "startedAt": 1_900_000})
    assert running.started_at == 1900.0 and running.queued_s == 900.0
    done = classify_job({"jobId": "j", "status": "SUCCEEDED", "createdAt": 1_000_000, "startedAt": 1_900_000,
                         "stoppedAt": 2_000_000})
    assert (done.queued_s, done.ended_at) == (900.0, 2000.0)


@pytest.mark.unit
def test_missing_aws_credentials_fail_the_preflight_as_user_error(monkeypatch, tmp_path):
    """No credentials anywhere: a setting to fix, not an INFRA failure retried three times."""
    from core import config
    from core.failures import UserError
    from operators.training import DistributedTrainingOperator
    from training.smoke_data import write_tiny_world

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AIRFLOW_CONN_AWS_DEFAULT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find either
    write_tiny_world(tmp_path / "storage", ["2026-11-01", "2026-11-02"], rows_per_day=20, pins=10)
    monkeypatch.setattr(config, "load", lambda: PlatformConfig(storage_root=str(tmp_path / "storage")))
    op = DistributedTrainingOperator(task_id="train", plan={"train_days": ["2026-11-01"], "eval_ds": "2026-11-02"},
                                     backend="batch")
    with pytest.raises(UserError, match="preflight: the batch backend: NoCredentialsError") as err:
        op._preflight(BatchBackend(BatchConfig(region_name="us-east-1"), TEAMS), "")
    assert err.value.failure_class is FailureClass.USER


@pytest.mark.unit
def test_the_checkpoint_key_comes_from_the_secret_store_never_from_the_definition():
    arn = "arn:aws:secretsmanager:us-east-1:123:secret:pinflow-checkpoint-key"
    container = backend(checkpoint_key_secret=arn).dry_run(spec())["job_definition"]["nodeProperties"][
        "nodeRangeProperties"][0]["container"]
    assert container["secrets"] == [{"name": "PINFLOW_CHECKPOINT_KEY", "valueFrom": arn}]
    assert "secrets" not in backend().dry_run(spec())["job_definition"]["nodeProperties"]["nodeRangeProperties"][0][
        "container"]
