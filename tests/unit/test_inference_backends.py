"""Corpus scoring as jobs, not worker loops: the array job of the scoring processes on each backend (local parallel
processes, an AWS Batch array job, a Kubernetes Indexed Job) and the KubeRay RayJob of the Ray engine, each built by
a pure dry run from the spec the scoring task sends and asserted whole; the classifiers on recorded objects."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.config import BatchConfig, PlatformConfig
from core.failures import FailureClass
from operators.backends import JobSpec, JobState
from operators.backends.batch import BatchBackend, classify_array_job
from operators.backends.kubernetes import (
    KubernetesBackend,
    check_manifest,
    classify_indexed_job,
    classify_rayjob,
    schema_errors,
)
from operators.backends.local import ARRAY_RUNNER, NODE_SUPERVISOR, REPO_ROOT, LocalBackend
from operators.backends.resources import Catalog
from operators.inference import scoring_job_spec

pytestmark = pytest.mark.unit
CFG = PlatformConfig(inference={"parallelism": 4})
PLAN = {"plan_file": "s3://pinflow/storage/inference/pin_ranker/7/ds=2026-11-20/_plans/0123456789abcdef/_PLAN.json"}
NAME = "score-pin-corpus-inference-manual-1-try1-0123456789"
SHARDS = [0, 1, 2, 5, 6, 7]
COMMAND = ["python", "-m", "training.inference", "--plan", PLAN["plan_file"], "--shards", "0-2,5-7", "--threads", "1"]
RAY_COMMAND = ["python", "-m", "training.ray_inference", "--plan", PLAN["plan_file"], "--shards", "0-2,5-7", "--cpus",
               "0", "--actors", "0", "--actor-cpus", "1.0", "--reader-cpus", "0.5", "--threads", "1"]
ENV = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
LABELS = {"kueue.x-k8s.io/queue-name": "ranking", "pinflow/team": "ranking", "pinflow/job": NAME,
          "pinflow/instance-type": "m5.2xlarge", "kueue.x-k8s.io/priority-class": "pinflow-ranking"}
POD_LABELS = {"pinflow/team": "ranking", "pinflow/job": NAME}


def spec(engine: str = "processes", backend: str = "batch", shards: list[int] = SHARDS) -> JobSpec:
    """What the scoring task sends (``operators.inference.scoring_job_spec``)."""
    return scoring_job_spec(PLAN, shards, name=NAME, engine=engine, backend=backend, cfg=CFG)


def kubernetes() -> KubernetesBackend:
    return KubernetesBackend(CFG.kubernetes, CFG.teams, Catalog.from_config(CFG), ray_version="2.60.0")


def test_the_scoring_spec_is_an_array_of_one_cpu_slices_or_one_ray_driver():
    assert spec() == JobSpec(
        name=NAME, command=COMMAND[1:], team="ranking", instance_type="m5.2xlarge", env={"OMP_NUM_THREADS": "1"},
        timeout_s=21600, array_size=6, array_parallelism=4, cpus_per_node=1, memory_gb_per_node=3.84,
    )
    assert spec("ray", "kubernetes") == JobSpec(
        name=NAME, command=RAY_COMMAND[1:], team="ranking", instance_type="m5.2xlarge", env={"OMP_NUM_THREADS": "1"},
        timeout_s=21600, engine="ray", ray_workers=2,
    )
    assert spec("ray", "local").ray_workers == 0  # a local Ray cluster on the job's own node


def test_batch_array_job_is_the_whole_request():
    request = BatchBackend(BatchConfig(job_role_arn="arn:aws:iam::123:role/pinflow"), CFG.teams,
                           Catalog.from_config(CFG)).dry_run(spec(), fair_share=True)
    definition = request["job_definition"]
    assert definition == {
        "jobDefinitionName": definition["jobDefinitionName"],
        "platformCapabilities": ["EC2"],
        "retryStrategy": {"attempts": 3, "evaluateOnExit": [
            {"onStatusReason": "Host EC2*", "action": "RETRY"},
            {"onReason": "CannotInspectContainerError:*", "action": "RETRY"},
            {"onReason": "DockerTimeoutError:*", "action": "RETRY"},
            {"onReason": "*", "action": "EXIT"},
        ]},
        "propagateTags": True,
        "type": "container",
        "containerProperties": {
            "image": "pinflow-training-cpu:latest",
            "command": ["python", "-m", "training.launch", "--help"],
            # One vCPU of an m5.2xlarge per shard, its share of the memory (32 GiB x 0.96 / 8).
            "resourceRequirements": [{"type": "VCPU", "value": "1"}, {"type": "MEMORY", "value": "3932"}],
            "linuxParameters": {"initProcessEnabled": True, "sharedMemorySize": 983},
            "ulimits": [
                {"name": "memlock", "softLimit": -1, "hardLimit": -1},
                {"name": "stack", "softLimit": 67108864, "hardLimit": 67108864},
                {"name": "nofile", "softLimit": 1024000, "hardLimit": 1024000},
            ],
            "logConfiguration": {"logDriver": "awslogs", "options": {"awslogs-group": "/aws/batch/job"}},
            "jobRoleArn": "arn:aws:iam::123:role/pinflow",
        },
    }
    assert definition["jobDefinitionName"].startswith("pinflow-ranking-")
    assert request["submit"] == {
        "jobName": NAME,
        "jobQueue": "ranking",
        "jobDefinition": definition["jobDefinitionName"],
        "shareIdentifier": "ranking",
        "schedulingPriorityOverride": 50,
        "timeout": {"attemptDurationSeconds": 21600},  # each child's own limit
        "tags": {"pinflow:team": "ranking", "pinflow:job": NAME, "pinflow:instance-type": "m5.2xlarge"},
        "propagateTags": True,
        "containerOverrides": {"command": COMMAND, "environment": ENV},
        "arrayProperties": {"size": 6},  # each child's shard: --shards[AWS_BATCH_JOB_ARRAY_INDEX]
    }


def test_batch_has_no_array_of_one_a_single_missing_shard_is_a_plain_job_at_index_0():
    submit = BatchBackend(teams=CFG.teams, catalog=Catalog.from_config(CFG)).dry_run(spec(shards=[3]))["submit"]
    assert "arrayProperties" not in submit
    assert submit["containerOverrides"]["environment"] == [
        {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PINFLOW_ARRAY_INDEX", "value": "0"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def batch_child(index: int, **container: Any) -> dict[str, Any]:
    return {"jobId": f"p1:{index}", "status": "FAILED", "arrayProperties": {"index": index},
            "statusReason": "Essential container in task exited", "container": container}


@pytest.mark.parametrize(("children", "klass", "says"), [
    ([batch_child(3, exitCode=137, reason="OutOfMemoryError: Container killed due to memory usage")],
     FailureClass.OOM, "array child 3"),
    ([batch_child(1, exitCode=65), batch_child(4, exitCode=137, reason="Host EC2 (instance i-0) terminated.")],
     FailureClass.INFRA, "host lost"),
    ([batch_child(2, exitCode=1)], FailureClass.USER, "exited with code 1"),
    ([batch_child(2, exitCode=75)], FailureClass.INFRA, "exited with code 75"),
])
def test_batch_array_job_is_classed_by_its_failed_children(children, klass, says):
    parent = {"jobId": "p1", "status": "FAILED", "statusReason": "Array Child Job failed", "createdAt": 1000,
              "stoppedAt": 9000, "arrayProperties": {"size": 6, "statusSummary": {"SUCCEEDED": 6 - len(children),
                                                                                  "FAILED": len(children)}}}
    status = classify_array_job(parent, children)
    assert status.state is JobState.FAILED and status.failure_class is klass
    assert says in status.reason and f"{len(children)} of 6 children failed" in status.reason


def test_batch_array_parent_is_pending_until_a_child_runs_then_running():
    parent = {"jobId": "p1", "status": "PENDING", "createdAt": 1000, "arrayProperties": {"size": 6, "statusSummary": {}}}
    assert classify_array_job(parent).state is JobState.PENDING
    parent["arrayProperties"]["statusSummary"] = {"RUNNING": 2, "RUNNABLE": 4}
    assert classify_array_job(parent).state is JobState.RUNNING
    assert classify_array_job({**parent, "status": "SUCCEEDED"}).state is JobState.SUCCEEDED


def test_kubernetes_indexed_job_is_the_whole_manifest():
    manifest = kubernetes().dry_run(spec(backend="kubernetes"))
    assert manifest == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": NAME, "namespace": "pinflow", "labels": LABELS},
        "spec": {
            "completionMode": "Indexed",
            "completions": 6,
            "parallelism": 4,
            "backoffLimitPerIndex": 0,
            "maxFailedIndexes": 6,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "podReplacementPolicy": "Failed",
            "suspend": True,
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": POD_LABELS},
                "spec": {
                    "containers": [{
                        "name": "task",
                        "image": "pinflow-training-cpu:latest",
                        "command": COMMAND,
                        "env": ENV,
                        "resources": {"requests": {"cpu": "950m", "memory": "3735Mi"},
                                      "limits": {"cpu": "1", "memory": "3932Mi"}},
                        "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
                    }],
                    "restartPolicy": "Never",
                    "nodeSelector": {"node.kubernetes.io/instance-type": "m5.2xlarge"},
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "983Mi"}}],
                    "priorityClassName": "pinflow-ranking",
                    "activeDeadlineSeconds": 21600,
                },
            },
        },
    }


@pytest.mark.parametrize(("mutate", "says"), [
    (lambda m: m["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"), "V1Job does not know"),
    (lambda m: m["spec"].pop("completionMode"), "Indexed Job"),
    (lambda m: m["spec"]["template"]["spec"].update(restartPolicy="OnFailure"), "restartPolicy Never"),
    (lambda m: m["spec"].update(maxFailedIndexes=7), "maxFailedIndexes"),
])
def test_bad_indexed_jobs_are_refused(mutate, says):
    manifest = copy.deepcopy(kubernetes().dry_run(spec(backend="kubernetes")))
    mutate(manifest)
    with pytest.raises(ValueError, match=says):
        check_manifest(manifest)


def ray_template(container: str) -> dict[str, Any]:
    spec_: dict[str, Any] = {
        "name": container, "image": "pinflow-training-cpu:latest", "env": ENV,
        "resources": {"requests": {"cpu": "7600m", "memory": "29884Mi"}, "limits": {"cpu": "8", "memory": "31457Mi"}},
        "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
    }
    if container == "ray-head":
        spec_["ports"] = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                          {"containerPort": 10001, "name": "client"}]
    return {"metadata": {"labels": POD_LABELS}, "spec": {
        "containers": [spec_],
        "nodeSelector": {"node.kubernetes.io/instance-type": "m5.2xlarge"},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "7864Mi"}}],
        "priorityClassName": "pinflow-ranking",
    }}


RAYJOB = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": {"name": NAME, "namespace": "pinflow", "labels": LABELS},
    "spec": {
        "entrypoint": " ".join(RAY_COMMAND),
        "activeDeadlineSeconds": 21600,
        "backoffLimit": 0,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 86400,
        "suspend": True,
        "rayClusterSpec": {
            "rayVersion": "2.60.0",
            # The head runs the driver only; readers and scoring actors run on the workers.
            "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                              "template": ray_template("ray-head")},
            "workerGroupSpecs": [{"groupName": "scorers", "replicas": 2, "minReplicas": 2, "maxReplicas": 2,
                                  "rayStartParams": {}, "template": ray_template("ray-worker")}],
        },
    },
}


def test_kuberay_rayjob_is_the_whole_manifest_and_fits_the_kept_crd_schema():
    manifest = kubernetes().dry_run(spec("ray", "kubernetes"))
    assert manifest == RAYJOB
    assert schema_errors(manifest, "rayjob") == []


def test_the_shipped_rayjob_example_is_what_the_backend_sends():
    """``deploy/kubernetes/corpus-scoring-rayjob.yaml`` documents the RayJob: the dry run of the default config."""
    shipped = yaml.safe_load((REPO_ROOT / "deploy/kubernetes/corpus-scoring-rayjob.yaml").read_text())
    check_manifest(shipped)
    sent = kubernetes().dry_run(scoring_job_spec(
        {"plan_file": shipped["spec"]["entrypoint"].split("--plan ")[1].split()[0]},
        [0, 1, 2, 3], name=shipped["metadata"]["name"], engine="ray", backend="kubernetes", cfg=PlatformConfig(),
    ))
    assert sent == shipped


@pytest.mark.parametrize(("mutate", "says"), [
    (lambda m: m["spec"].update(entrypoints="x"), "Additional properties"),
    (lambda m: m["spec"].update(backoffLimit="0"), "is not of type 'integer'"),
    (lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required"),
    (lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .update(resourcez={}), "Additional properties"),
])
def test_bad_rayjobs_are_refused(mutate, says):
    manifest = copy.deepcopy(RAYJOB)
    mutate(manifest)
    with pytest.raises(ValueError, match=says):
        check_manifest(manifest)


def indexed(*conditions: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s", "creationTimestamp": "2026-11-20T10:00:00Z"}, "spec": {"completions": 6},
            "status": {"conditions": [{"type": c, "status": "True", "reason": "FailedIndexes", "message": "m"}
                                      for c in conditions], **status}}


def pod(index: int, code: int | None = None, reason: str | None = None, signal: int | None = None,
        disrupted: bool = False) -> dict[str, Any]:
    terminated = {k: v for k, v in {"exitCode": code, "reason": reason, "signal": signal}.items() if v is not None}
    status: dict[str, Any] = {"phase": "Failed", "containerStatuses": [{"name": "task", "state": {"terminated": terminated}}]}
    if disrupted:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    return {"metadata": {"name": f"s-{index}-abc"}, "status": status}


def test_indexed_job_states_and_classes():
    assert classify_indexed_job(indexed("Suspended")).state is JobState.PENDING
    assert classify_indexed_job(indexed()).state is JobState.PENDING
    assert classify_indexed_job(indexed(ready=2, startTime="2026-11-20T10:01:00Z")).state is JobState.RUNNING
    assert classify_indexed_job(indexed("Complete", succeeded=6)).state is JobState.SUCCEEDED
    killed = classify_indexed_job(indexed("Failed", failedIndexes="3", succeeded=5), [pod(3, 137, "Error", signal=9)])
    assert killed.failure_class is FailureClass.INFRA and "indexes 3 failed, 5 of 6 succeeded" in killed.reason
    oom = classify_indexed_job(indexed("Failed", failedIndexes="1,4"), [pod(1, 137, "OOMKilled"), pod(4, 75)])
    assert oom.failure_class is FailureClass.OOM
    assert classify_indexed_job(indexed("Failed"), [pod(2, 65)]).failure_class is FailureClass.DATA


@pytest.mark.parametrize(("status", "state", "klass"), [
    ({}, JobState.PENDING, None),
    ({"jobDeploymentStatus": "Initializing"}, JobState.PENDING, None),
    ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, JobState.RUNNING, None),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}, JobState.SUCCEEDED, None),
    ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
      "message": "Job entrypoint command failed with exit code 65"}, JobState.FAILED, FailureClass.DATA),
    ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
      "message": "Job entrypoint command failed with exit code 1"}, JobState.FAILED, FailureClass.USER),
    ({"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"}, JobState.FAILED, FailureClass.INFRA),
    ({"jobDeploymentStatus": "Failed", "reason": "SubmissionFailed"}, JobState.FAILED, FailureClass.INFRA),
])
def test_rayjob_states_and_classes(status, state, klass):
    found = classify_rayjob({"metadata": {"name": "s"}, "spec": {}, "status": status})
    assert found.state is state and found.failure_class is klass and found.job_id == "rayjob/s"


def test_local_array_job_is_parallel_processes_under_a_runner(tmp_path: Path):
    request = LocalBackend(tmp_path).dry_run(spec(backend="local", shards=[0, 3, 4]))
    job = tmp_path / "jobs" / NAME
    assert request == {
        "job_name": NAME,
        "job_dir": str(job),
        "team": "ranking",
        "timeout_s": 21600,
        "env": {"PYTHONPATH": request["env"]["PYTHONPATH"], "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        "nodes": [
            {"argv": [sys.executable, *COMMAND[1:6], "0,3-4", *COMMAND[7:]], "log": str(job / f"node-{i}.log"),
             "exit_file": str(job / f"node-{i}.exit"), "end_file": str(job / f"node-{i}.end.json"),
             "env": {"PINFLOW_ARRAY_INDEX": str(i)}}
            for i in range(3)
        ],
        "array": {"size": 3, "parallelism": 3},  # at most inference.parallelism (4), at most the array
    }
    assert request["env"]["PYTHONPATH"].split(":")[0] == str(REPO_ROOT)
    assert ARRAY_RUNNER.exists() and NODE_SUPERVISOR.exists()
