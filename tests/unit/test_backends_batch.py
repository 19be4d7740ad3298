"""The AWS Batch backend's request (a pure dry run, asserted whole) and its classifier on recorded responses."""

from __future__ import annotations

import pytest

from core.config import BatchConfig, PlatformConfig, TeamConfig
from core.failures import FailureClass
from operators.backends import JobSpec, JobState, get_backend
from operators.backends.batch import RETRY_ON_EXIT, BatchBackend, classify_job

TEAMS = {"ranking": TeamConfig(queue="ranking-gpu", share="ranking", priority=50)}


def spec(**change):
    base = dict(name="train-abc-try1-0123456789", command=["-m", "training.train", "--config", "s3://b/runs/x/RUN.json"],
                team="ranking", image="123.dkr.ecr.us-east-1.amazonaws.com/pinflow-training:1.2", distributed=True,
                nodes=2, procs_per_node=8, cpus_per_node=96, memory_gb_per_node=1100, gpus_per_node=8,
                env={"OMP_NUM_THREADS": "1"}, timeout_s=7200, checkpoint_dir="s3://b/models/x/checkpoints")
    return JobSpec(**{**base, **change})


def backend(**opts):
    return BatchBackend(BatchConfig(**{"efa_devices": 2, "job_role_arn": "arn:aws:iam::123:role/pinflow", **opts}), TEAMS)


@pytest.mark.unit
def test_dry_run_is_the_whole_request():
    request = backend().dry_run(spec())
    definition = request["job_definition"]
    name = definition.pop("jobDefinitionName")
    assert name.startswith("pinflow-ranking-") and len(name) == len("pinflow-ranking-") + 12
    container = {
        "image": "123.dkr.ecr.us-east-1.amazonaws.com/pinflow-training:1.2",
        "command": ["python", "-m", "training.launch", "--help"],
        "resourceRequirements": [
            {"type": "VCPU", "value": "96"}, {"type": "MEMORY", "value": str(1100 * 1024)}, {"type": "GPU", "value": "8"},
        ],
        "linuxParameters": {
            "sharedMemorySize": 16384,
            "devices": [
                {"hostPath": f"/dev/infiniband/uverbs{i}", "containerPath": f"/dev/infiniband/uverbs{i}",
                 "permissions": ["READ", "WRITE", "MKNOD"]}
                for i in range(2)
            ],
        },
        "ulimits": [
            {"name": "memlock", "softLimit": -1, "hardLimit": -1},
            {"name": "nofile", "softLimit": 65536, "hardLimit": 65536},
            {"name": "stack", "softLimit": 67108864, "hardLimit": 67108864},
        ],
        "logConfiguration": {"logDriver": "awslogs", "options": {"awslogs-group": "/aws/batch/job"}},
        "jobRoleArn": "arn:aws:iam::123:role/pinflow",
    }
    assert definition == {
        "platformCapabilities": ["EC2"],
        "retryStrategy": {"attempts": 3, "evaluateOnExit": RETRY_ON_EXIT},
        "propagateTags": True,
        "type": "multinode",
        "nodeProperties": {"numNodes": 2, "mainNode": 0, "nodeRangeProperties": [{"targetNodes": "0:", "container": container}]},
    }
    assert request["submit"] == {
        "jobName": "train-abc-try1-0123456789",
        "jobQueue": "ranking-gpu",
        "jobDefinition": name,
        "shareIdentifier": "ranking",
        "schedulingPriorityOverride": 50,
        "timeout": {"attemptDurationSeconds": 7200},
        "tags": {"pinflow:team": "ranking", "pinflow:job": "train-abc-try1-0123456789"},
        "propagateTags": True,
        "nodeOverrides": {
            "numNodes": 2,
            "nodePropertyOverrides": [{
                "targetNodes": "0:",
                "containerOverrides": {
                    "command": ["python", "-m", "training.launch", "--nproc-per-node=8",
                                "--rdzv-id=train-abc-try1-0123456789", "--", "-m", "training.train", "--config",
                                "s3://b/runs/x/RUN.json"],
                    "environment": [
                        {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"}, {"name": "FI_PROVIDER", "value": "efa"},
                        {"name": "NCCL_PROTO", "value": "simple"}, {"name": "OMP_NUM_THREADS", "value": "1"},
                        {"name": "PINFLOW_CHECKPOINT_DIR", "value": "s3://b/models/x/checkpoints"},
                        {"name": "PINFLOW_RDZV_PORT", "value": "29400"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
                    ],
                },
            }],
        },
    }


@pytest.mark.unit
def test_definition_name_follows_content_only():
    b = backend()
    same = b.dry_run(spec(name="other-job", command=["-m", "x"]))["job_definition"]["jobDefinitionName"]
    assert same == b.dry_run(spec())["job_definition"]["jobDefinitionName"]
    assert b.dry_run(spec(image="pinflow-training:1.3"))["job_definition"]["jobDefinitionName"] != same


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"team": "search"}, "team 'search' is not under teams:"),
        ({"gpus_per_node": 16, "procs_per_node": 16}, "batch.max_gpus_per_node"),
        ({"procs_per_node": 9}, "procs_per_node=9 > gpus_per_node=8"),
        ({"image": "Not An Image"}, "training.image"),
    ],
)
def test_spec_checked_against_config_naming_the_setting(change, says):
    with pytest.raises(ValueError) as err:
        backend().dry_run(spec(**change))
    assert says in str(err.value)


@pytest.mark.unit
def test_get_backend_builds_it_from_config():
    b = get_backend("batch", PlatformConfig(home="/tmp", teams=TEAMS, batch=BatchConfig(region_name="eu-west-1")))
    assert isinstance(b, BatchBackend) and b.options.region_name == "eu-west-1" and b.options.efa_devices == 0
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


@pytest.mark.unit
@pytest.mark.parametrize(
    ("job", "nodes", "klass", "says"),
    [
        (SPOT_LOSS, [], FailureClass.INFRA, "Host EC2"),
        (NODE_FAILED_PARENT, [NODE_0_NAN, NODE_1_PEER_GONE], FailureClass.USER, "node 0 exited with code 76"),
        (NODE_FAILED_PARENT | {"jobId": "j3"}, [NODE_0_NAN, NODE_1_SPOT], FailureClass.INFRA, "node 1: Host EC2"),
        (OOM, [], FailureClass.OOM, "OutOfMemoryError"),
        (TIMEOUT, [], FailureClass.INFRA, "timeout"),
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
        op._preflight(BatchBackend(BatchConfig(region_name="us-east-1"), TEAMS))
    assert err.value.failure_class is FailureClass.USER
