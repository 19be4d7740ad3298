"""The Kubernetes backend: a Kubeflow Trainer v2 TrainJob (and the v1 PyTorchJob option) asserted whole and
validated against the CRD schemas kept in operators/backends/crds/ (Trainer v2.3, JobSet v0.12, training-operator
v1), the ClusterTrainingRuntime pinflow ships, the classifiers on recorded objects, and reattaching on 409."""

from __future__ import annotations

import copy

import pytest
import yaml

from core.config import KubernetesConfig, PlatformConfig, TeamConfig
from core.failures import FailureClass
from operators.backends import JobSpec, JobState
from operators.backends.kubernetes import (
    RUNTIME_FILE,
    KubernetesBackend,
    check_manifest,
    classify_pytorchjob,
    classify_trainjob,
    job_state,
    render_jobset,
    schema_errors,
    shipped_runtime,
    trainjob_state,
)
from operators.backends.resources import Catalog

TEAMS = {"ranking": TeamConfig(queue="ranking", share="ranking", priority=50, priority_class="pinflow-ranking",
                               instance_type="p5.48xlarge")}
CATALOG = Catalog.from_config(PlatformConfig(teams=TEAMS, images={"gpu": "registry.example.com/pinflow-training:1.2"}))
NAME = "train-abc-try1-0123456789"
COMMAND = ["python", "-m", "training.launch", "--nproc-per-node=8", f"--rdzv-id={NAME}", "--preflight", "--",
           "-m", "training.train", "--config", "s3://b/RUN.json"]
# A whole p5.48xlarge: limits of the node (memory less the 4 % tax), requests 5 % below; EFA with hugepages.
P5_RESOURCES = {
    "requests": {"cpu": "182400m", "memory": "1912601Mi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
                 "hugepages-2Mi": "5Gi"},
    "limits": {"cpu": "192", "memory": "2013265Mi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
               "hugepages-2Mi": "5Gi"},
}
P5_ENV = [
    {"name": "FI_EFA_FORK_SAFE", "value": "1"}, {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
    {"name": "FI_PROVIDER", "value": "efa"}, {"name": "NCCL_SOCKET_IFNAME", "value": "^lo"},
    {"name": "PINFLOW_CHECKPOINT_DIR", "value": "s3://b/models/x/checkpoints"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
]
P5_POD = {
    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "48Gi"}}],
}
LABELS = {"kueue.x-k8s.io/queue-name": "ranking", "pinflow/team": "ranking", "pinflow/job": NAME,
          "pinflow/instance-type": "p5.48xlarge"}


def spec(**change):
    """2 nodes x 8 GPUs on the team's p5.48xlarge, as the training operator sends it."""
    base = dict(name=NAME, command=["-m", "training.train", "--config", "s3://b/RUN.json"], team="ranking",
                distributed=True, nodes=2, procs_per_node=8, timeout_s=3600,
                checkpoint_dir="s3://b/models/x/checkpoints", preflight=True)
    return JobSpec(**{**base, **change})


def backend(**opts):
    return KubernetesBackend(KubernetesConfig(**{"namespace": "ml", **opts}), TEAMS, CATALOG)


@pytest.mark.unit
def test_dry_run_of_a_2_node_8_gpu_p5_job_is_the_whole_trainjob():
    assert backend().dry_run(spec()) == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": NAME, "namespace": "ml",
                     "labels": {**LABELS, "kueue.x-k8s.io/priority-class": "pinflow-ranking"}},
        "spec": {
            "runtimeRef": {"name": "pinflow-torch", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "activeDeadlineSeconds": 3600,
            "trainer": {
                "image": "registry.example.com/pinflow-training:1.2",
                "command": COMMAND,
                "numNodes": 2,
                "resourcesPerNode": P5_RESOURCES,
                "env": P5_ENV,
                "numProcPerNode": 8,
            },
            "runtimePatches": [{
                "manager": "pinflow.io/airflow",
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": "node",
                    "template": {"spec": {"template": {
                        "metadata": {"labels": {"pinflow/team": "ranking", "pinflow/job": NAME}},
                        "spec": {**P5_POD, "containers": [
                            {"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]},
                    }}},
                }]}}},
            }],
        },
    }


@pytest.mark.unit
def test_the_trainjob_renders_with_the_shipped_runtime_into_a_valid_jobset():
    manifest = backend().dry_run(spec())
    jobset = render_jobset(manifest, shipped_runtime())
    assert schema_errors(jobset, "jobset") == []
    job = jobset["spec"]["replicatedJobs"][0]
    assert (job["replicas"], job["template"]["spec"]["parallelism"], job["template"]["spec"]["backoffLimit"]) == (1, 2, 0)
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == P5_POD["nodeSelector"] and pod["volumes"] == P5_POD["volumes"]
    container = pod["containers"][0]
    assert container["command"] == COMMAND and container["resources"] == P5_RESOURCES
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_NNODES"] == "2" and env["PET_MASTER_ADDR"] == f"{NAME}-node-0-0.{NAME}" and env["FI_PROVIDER"] == "efa"
    # The pod failure policy of the runtime: disruptions ignored, USER/DATA codes fail the job at once.
    rules = job["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["onExitCodes"] == {"containerName": "node", "operator": "In", "values": [1, 65, 76]}


@pytest.mark.unit
def test_the_shipped_runtime_validates_against_the_kept_crd_schemas():
    runtime = yaml.safe_load(RUNTIME_FILE.read_text())
    check_manifest(runtime)
    assert runtime["metadata"]["name"] == KubernetesConfig().runtime
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {
        "maxRestarts": 0, "rules": [{"name": "user-or-data-error", "action": "FailJobSet",
                                     "onJobFailureReasons": ["PodFailurePolicy"]}]}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda m: m["spec"].pop("runtimeRef"), "'runtimeRef' is a required property"),
        (lambda m: m["spec"]["trainer"].update(numNode=2), "Additional properties are not allowed ('numNode'"),
        (lambda m: m["spec"]["trainer"].update(env=[{"name": "PET_NNODES", "value": "2"}]), "PET_NNODES"),
        (lambda m: m["spec"]["runtimePatches"][0].update(manager="pinflow"), "domain-prefixed path"),
        (lambda m: m["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
         .update(name="launcher"), "'launcher', not in the runtime"),
        (lambda m: m["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
         ["template"]["spec"]["template"]["spec"]["containers"][0].update(env=[{"name": "A", "value": "1"}]),
         "must not set env of the node container"),
        (lambda m: m["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
         ["template"]["spec"]["template"]["spec"].update(hostname="x"), "Additional properties are not allowed"),
        (lambda m: m["spec"]["trainer"]["resourcesPerNode"]["limits"].update(cpu=[1]), "is not valid under any"),
    ],
)
def test_bad_trainjobs_are_refused(mutate, says):
    manifest = copy.deepcopy(backend().dry_run(spec()))
    mutate(manifest)
    with pytest.raises(ValueError) as err:
        check_manifest(manifest)
    assert says in str(err.value)


@pytest.mark.unit
def test_a_cpu_scoring_job_has_no_gpu_efa_or_tolerations():
    manifest = backend().dry_run(spec(distributed=False, nodes=1, procs_per_node=1, instance_type="m5.2xlarge",
                                      command=["-m", "training.inference"], checkpoint_dir=None, preflight=False))
    trainer = manifest["spec"]["trainer"]
    assert trainer["command"] == ["python", "-m", "training.inference"] and "numProcPerNode" not in trainer
    assert trainer["resourcesPerNode"] == {"requests": {"cpu": "7600m", "memory": "29884Mi"},
                                           "limits": {"cpu": "8", "memory": "31457Mi"}}
    assert trainer["env"] == [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    pod = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert "tolerations" not in pod and pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "m5.2xlarge"}
    assert trainer["image"] == "pinflow-training-cpu:latest"


@pytest.mark.unit
def test_pytorchjob_option_is_the_whole_manifest():
    manifest = backend(api="pytorchjob").dry_run(spec(nodes=3))
    template = {
        "metadata": {"labels": {"pinflow/team": "ranking", "pinflow/job": NAME}},
        "spec": {
            "containers": [{
                "name": "pytorch",
                "image": "registry.example.com/pinflow-training:1.2",
                "command": COMMAND,
                "env": P5_ENV,
                "ports": [{"containerPort": 29400, "name": "pytorchjob-port"}],
                "resources": P5_RESOURCES,
                "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
            }],
            "restartPolicy": "Never",
            **P5_POD,
            "priorityClassName": "pinflow-ranking",
        },
    }
    assert manifest == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": NAME, "namespace": "ml", "labels": LABELS},
        "spec": {
            "nprocPerNode": "8",
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "Never", "template": template},
                "Worker": {"replicas": 2, "restartPolicy": "Never", "template": template},
            },
            "runPolicy": {"backoffLimit": 0, "activeDeadlineSeconds": 3600, "cleanPodPolicy": "Running",
                          "ttlSecondsAfterFinished": 86400},
        },
    }


@pytest.mark.unit
def test_pod_template_loads_through_the_client_models():
    from kubernetes.client import ApiClient, V1PodTemplateSpec

    manifest = backend(api="pytorchjob").dry_run(spec())
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    model = ApiClient()._ApiClient__deserialize(template, "V1PodTemplateSpec")
    assert isinstance(model, V1PodTemplateSpec)
    assert model.spec.containers[0].resources.limits["vpc.amazonaws.com/efa"] == "32"
    assert model.spec.volumes[0].empty_dir.medium == "Memory"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda m: m["spec"].pop("pytorchReplicaSpecs"), "'pytorchReplicaSpecs' is a required property"),
        (lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"].update(restartPolicy="Sometimes"), "is not one of"),
        (lambda m: m["metadata"].update(name="Bad_Name"), "does not match"),
        (lambda m: m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
            volumeMount=[]), "V1PodTemplateSpec does not know"),
        (lambda m: m["spec"]["pytorchReplicaSpecs"].update(Chief=m["spec"]["pytorchReplicaSpecs"]["Master"]), "Master (+ Worker)"),
    ],
)
def test_bad_pytorchjobs_are_refused(mutate, says):
    manifest = copy.deepcopy(backend(api="pytorchjob").dry_run(spec()))
    mutate(manifest)
    with pytest.raises(ValueError) as err:
        check_manifest(manifest)
    assert says in str(err.value)


@pytest.mark.unit
def test_single_node_has_no_workers_and_unknown_team_is_refused():
    manifest = backend(api="pytorchjob").dry_run(spec(nodes=1))
    assert list(manifest["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    with pytest.raises(ValueError, match="team 'search' is not under teams:"):
        backend().dry_run(spec(team="search"))


@pytest.mark.unit
def test_console_url_names_the_api():
    assert backend().console_url("j") == (
        "https://kubernetes-dashboard/#/customresourcedefinition/trainjobs.trainer.kubeflow.org/ml/j")


def job(*conditions, name="j"):
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions]}}


def pod(name, code=None, reason=None, pod_reason=None):
    terminated = {"exitCode": code, **({"reason": reason} if reason else {})} if code is not None else None
    return {"metadata": {"name": name}, "status": {
        **({"reason": pod_reason} if pod_reason else {}),
        "containerStatuses": [{"name": "pytorch", "state": {"terminated": terminated} if terminated else {}}]}}


@pytest.mark.unit
def test_state_from_conditions():
    assert job_state(job()) is JobState.PENDING
    assert job_state(job(("Created", "", ""), ("Running", "", ""))) is JobState.RUNNING
    assert job_state(job(("Created", "", ""), ("Running", "", ""), ("Succeeded", "", ""))) is JobState.SUCCEEDED


FAILED = ("Failed", "PyTorchJobFailed", "PyTorchJob j is failed because 1 Worker replica(s) failed.")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pods", "klass", "says"),
    [
        ([pod("j-master-0", 1), pod("j-worker-0", 75)], FailureClass.USER, "j-master-0 exited with code 1"),
        ([pod("j-master-0", 75), pod("j-worker-0", 137, "OOMKilled")], FailureClass.OOM, "OOMKilled"),
        ([pod("j-master-0", 76), pod("j-worker-0", pod_reason="Evicted")], FailureClass.INFRA, "Evicted"),
        ([], FailureClass.INFRA, "no pod says why"),
    ],
)
def test_classifier_on_recorded_pods(pods, klass, says):
    status = classify_pytorchjob(job(("Running", "", ""), FAILED), pods)
    assert status.state is JobState.FAILED and status.failure_class is klass and says in status.reason, status


class FakeHook:
    """Answers create with 409 the second time, as the API server does for an existing name."""

    def __init__(self):
        self.created: dict[str, dict] = {}

    def create_custom_object(self, group, version, plural, body, namespace=None):
        from kubernetes.client.exceptions import ApiException

        if body["metadata"]["name"] in self.created:
            raise ApiException(status=409, reason="AlreadyExists")
        self.created[body["metadata"]["name"]] = body

    def get_custom_object(self, group, version, plural, name, namespace=None):
        from kubernetes.client.exceptions import ApiException

        if name not in self.created:
            raise ApiException(status=404, reason="NotFound")
        return {**self.created[name], "status": {"conditions": [{"type": "Running", "status": "True"}]}}


@pytest.mark.unit
def test_create_twice_reattaches():
    b = backend(api="pytorchjob")
    b._hook = FakeHook()
    assert b.find(spec().name) is None
    assert b.submit(spec()) == b.submit(spec()) == spec().name
    assert len(b._hook.created) == 1
    assert b.status(spec().name).state is JobState.RUNNING


def trainjob(*conditions, jobs=None, name="j"):
    status = {"conditions": [{"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions]}
    if jobs is not None:
        status["jobsStatus"] = jobs
    return {"metadata": {"name": name, "creationTimestamp": "2026-11-05T10:00:00Z"}, "status": status}


def node_job(**counts):
    return {"name": "node", **{k: 0 for k in ("active", "failed", "ready", "succeeded", "suspended")}, **counts}


@pytest.mark.unit
def test_trainjob_states_a_queued_job_is_pending_until_every_pod_runs():
    held = trainjob(("Suspended", "Suspended", "Workload is waiting for quota"))
    assert trainjob_state(held) == (JobState.PENDING, "suspended: Workload is waiting for quota")
    assert trainjob_state(trainjob())[0] is JobState.PENDING  # no JobSet yet
    assert trainjob_state(trainjob(jobs=[node_job(active=1)]))[0] is JobState.PENDING  # pods scheduling, pulling
    assert trainjob_state(trainjob(jobs=[node_job(active=1, ready=1)]))[0] is JobState.RUNNING
    assert trainjob_state(trainjob(("Complete", "JobsCompleted", "")))[0] is JobState.SUCCEEDED
    status = classify_trainjob(held)
    assert status.state is JobState.PENDING and status.created_at == 1793872800.0 and "quota" in status.reason


def trainjob_pod(name, code=None, reason=None, pod_reason=None, signal=None, disrupted=False):
    terminated = {"exitCode": code, **({"reason": reason} if reason else {}), **({"signal": signal} if signal else {})}
    return {"metadata": {"name": name}, "status": {
        **({"reason": pod_reason} if pod_reason else {}),
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}] if disrupted
        else [],
        "containerStatuses": [{"name": "node", "state": {"terminated": terminated} if code is not None else {}}]}}


TJ_FAILED = ("Failed", "FailedJobs", "jobset failed due to PodFailurePolicy")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pods", "reason", "klass", "says"),
    [
        ([trainjob_pod("j-node-0-0", 65), trainjob_pod("j-node-0-1", 75)], TJ_FAILED, FailureClass.DATA, "exited with code 65"),
        ([trainjob_pod("j-node-0-0", 137, "OOMKilled"), trainjob_pod("j-node-0-1", 75)], TJ_FAILED, FailureClass.OOM, "OOMKilled"),
        ([trainjob_pod("j-node-0-0", 137, "Error", signal=9)], TJ_FAILED, FailureClass.INFRA, "SIGKILL (not OOMKilled)"),
        ([trainjob_pod("j-node-0-0", 76), trainjob_pod("j-node-0-1", 143, disrupted=True)], TJ_FAILED, FailureClass.INFRA,
         "PreemptionByScheduler"),
        ([], TJ_FAILED, FailureClass.USER, "USER or DATA code"),
        ([], ("Failed", "DeadlineExceeded", "activeDeadlineSeconds exceeded"), FailureClass.INFRA, "DeadlineExceeded"),
    ],
)
def test_trainjob_classifier_on_recorded_pods(pods, reason, klass, says):
    status = classify_trainjob(trainjob(reason), pods)
    assert status.state is JobState.FAILED and status.failure_class is klass and says in status.reason, status
    assert status.reason.startswith("TrainJob j failed:")


@pytest.mark.unit
def test_the_checkpoint_key_comes_from_a_secret_never_from_the_spec():
    manifest = backend(checkpoint_key_secret="pinflow-checkpoint/key").dry_run(spec())
    env = manifest["spec"]["trainer"]["env"]
    assert env[-1] == {"name": "PINFLOW_CHECKPOINT_KEY",
                       "valueFrom": {"secretKeyRef": {"name": "pinflow-checkpoint", "key": "key"}}}
    assert schema_errors(render_jobset(manifest, shipped_runtime()), "jobset") == []
    assert "PINFLOW_CHECKPOINT_KEY" not in {e["name"] for e in backend().dry_run(spec())["spec"]["trainer"]["env"]}
