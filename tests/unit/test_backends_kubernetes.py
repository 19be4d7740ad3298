"""The Kubernetes backend's PyTorchJob manifest (asserted whole, against the CRD schema and the client's
models), its classifier on recorded objects, and reattaching on 409."""

from __future__ import annotations

import copy

import pytest

from core.config import KubernetesConfig, TeamConfig
from core.failures import FailureClass
from operators.backends import JobSpec, JobState
from operators.backends.kubernetes import KubernetesBackend, check_manifest, classify_pytorchjob, job_state

TEAMS = {"ranking": TeamConfig(queue="ranking", share="ranking", priority=50, priority_class="pinflow-ranking")}


def spec(**change):
    base = dict(name="train-abc-try1-0123456789", command=["-m", "training.train", "--config", "s3://b/RUN.json"],
                team="ranking", image="registry.example.com/pinflow-training:1.2", distributed=True, nodes=3,
                procs_per_node=4, cpus_per_node=32, memory_gb_per_node=256, gpus_per_node=4, timeout_s=3600)
    return JobSpec(**{**base, **change})


@pytest.mark.unit
def test_manifest_is_the_whole_pytorchjob():
    manifest = KubernetesBackend(KubernetesConfig(namespace="ml"), TEAMS).dry_run(spec())
    template = {
        "metadata": {"labels": {"pinflow/team": "ranking", "pinflow/job": "train-abc-try1-0123456789"}},
        "spec": {
            "containers": [{
                "name": "pytorch",
                "image": "registry.example.com/pinflow-training:1.2",
                "command": ["python", "-m", "training.launch", "--nproc-per-node=4", "--rdzv-id=train-abc-try1-0123456789",
                            "--", "-m", "training.train", "--config", "s3://b/RUN.json"],
                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                "ports": [{"containerPort": 29400, "name": "pytorchjob-port"}],
                "resources": {"requests": {"cpu": "32", "memory": "256Gi"},
                              "limits": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "4"}},
                "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
            "restartPolicy": "Never",
            "priorityClassName": "pinflow-ranking",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    assert manifest == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "train-abc-try1-0123456789", "namespace": "ml",
                     "labels": {"kueue.x-k8s.io/queue-name": "ranking", "pinflow/team": "ranking"}},
        "spec": {
            "nprocPerNode": "4",
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "Never", "template": template},
                "Worker": {"replicas": 2, "restartPolicy": "Never", "template": template},
            },
            "runPolicy": {"backoffLimit": 0, "activeDeadlineSeconds": 3600, "cleanPodPolicy": "None",
                          "ttlSecondsAfterFinished": 86400},
        },
    }


@pytest.mark.unit
def test_pod_template_loads_through_the_client_models():
    from kubernetes.client import ApiClient, V1PodTemplateSpec

    manifest = KubernetesBackend(KubernetesConfig(), TEAMS).dry_run(spec())
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    model = ApiClient()._ApiClient__deserialize(template, "V1PodTemplateSpec")
    assert isinstance(model, V1PodTemplateSpec)
    assert model.spec.containers[0].resources.limits["nvidia.com/gpu"] == "4"
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
def test_bad_manifests_are_refused(mutate, says):
    manifest = copy.deepcopy(KubernetesBackend(KubernetesConfig(), TEAMS).dry_run(spec()))
    mutate(manifest)
    with pytest.raises(ValueError) as err:
        check_manifest(manifest)
    assert says in str(err.value)


@pytest.mark.unit
def test_single_node_has_no_workers_and_unknown_team_is_refused():
    manifest = KubernetesBackend(KubernetesConfig(), TEAMS).dry_run(spec(nodes=1))
    assert list(manifest["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    with pytest.raises(ValueError, match="team 'search' is not under teams:"):
        KubernetesBackend(KubernetesConfig(), TEAMS).dry_run(spec(team="search"))


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
    backend = KubernetesBackend(KubernetesConfig(), TEAMS)
    backend._hook = FakeHook()
    assert backend.find(spec().name) is None
    assert backend.submit(spec()) == backend.submit(spec()) == spec().name
    assert len(backend._hook.created) == 1
    assert backend.status(spec().name).state is JobState.RUNNING
