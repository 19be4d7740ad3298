"""Kubeflow Trainer v2 ``TrainJob``s (or v1 ``PyTorchJob``s) through the cncf.kubernetes provider's hook.

``kubernetes.api: trainjob`` (the default): a ``TrainJob`` against the ``ClusterTrainingRuntime`` pinflow ships
(``deploy/kubernetes/cluster-training-runtime.yaml``: one replicated Job ``node`` with the Torch ML policy, a pod
failure policy that ignores disruptions and fails at once on the USER/DATA exit codes, no in-cluster restarts).
The TrainJob sets the image, the command, ``numNodes``, ``numProcPerNode``, the node's resources and environment,
and patches (``runtimePatches``) the pod template with the node selector of its instance type, the GPU
toleration and the memory-backed ``/dev/shm``. The Trainer sets ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, from which ``python -m training.launch`` starts torchrun.

``kubernetes.api: pytorchjob``: the training-operator v1 ``PyTorchJob`` (one ``Master`` and ``nodes - 1``
``Worker`` replicas, ``nprocPerNode``), with ``cleanPodPolicy: Running`` (pods still running when the job ends
are deleted and free their GPUs; finished pods stay for their logs and exit codes).

Both: resources from the instance type (``operators.backends.resources``): limits of the whole node, requests
slightly below (a whole-node pod must fit beside the node's DaemonSets), ``nvidia.com/gpu``, one
``vpc.amazonaws.com/efa`` per EFA interface with ``hugepages-2Mi``, the libfabric / NCCL environment of AWS's
EKS examples, ``/dev/shm`` inside the memory limit, ``nodeSelector`` by ``node.kubernetes.io/instance-type``;
the team's Kueue ``LocalQueue`` (``kueue.x-k8s.io/queue-name``) and ``WorkloadPriorityClass``
(``kueue.x-k8s.io/priority-class``) as labels. Kueue holds the job (suspended: PENDING) until its quota admits
every node at once.

Besides training: an array job (``JobSpec.array_size``, corpus-scoring shards) is a ``batch/v1`` **Indexed Job**
(``completionMode: Indexed``, ``completions`` = the array's size, ``parallelism``; each pod is told its index in
``JOB_COMPLETION_INDEX``; ``backoffLimitPerIndex: 0`` and ``maxFailedIndexes`` = the size, so a failed index
stops nothing else and is left to Airflow's retry; a disrupted pod is replaced without counting), suspended
for Kueue like the others, its manifest checked against the kubernetes client's ``V1Job`` model and the Job
API's rules; its id is ``job/<name>``. A Ray job (``JobSpec.engine == "ray"``) is a KubeRay ``RayJob``
(``ray.io/v1``): a head and ``ray_workers`` worker pods of the instance type, the driver submitted by KubeRay's
submitter Job, the cluster deleted when the job ends; checked against the kept ``RayJob`` CRD schema (KubeRay
v1.7.0) and each pod template against ``V1PodTemplateSpec``; its id is ``rayjob/<name>``.

Every manifest is checked before it is sent (:func:`check_manifest`): against the CRD schemas kept in
``crds/`` (Trainer v2.3 ``TrainJob`` and ``ClusterTrainingRuntime``, JobSet v0.12, training-operator v1
``PyTorchJob``), rejecting unknown fields as the API server's strict field validation does; a TrainJob also
against the Trainer's admission rules (patches only of the runtime's jobs and containers, no reserved
``PET_*`` variables) and, rendered with the shipped runtime into the JobSet the Trainer would create, against
the JobSet schema and the kubernetes client's ``V1PodTemplateSpec`` model. The job's name is its id: creating
it twice answers 409, and the backend reattaches to the existing job.
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from core.config import KubernetesConfig, PlatformConfig, TeamConfig
from core.failures import ConfigError, FailureClass, Finding, classify_exit_code, decide
from operators.backends.base import JobSpec, JobState, JobStatus, launch_command, validate_for
from operators.backends.resources import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    K8S_INSTANCE_TYPE,
    Catalog,
    NodeResources,
    efa_environment,
    mib_quantity,
    milli_quantity,
    resolve,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = Path(__file__).with_name("crds")
RUNTIME_FILE = REPO_ROOT / "deploy" / "kubernetes" / "cluster-training-runtime.yaml"


@dataclass(frozen=True)
class Api:
    group: str
    version: str
    plural: str
    kind: str
    container: str  # the training container's name
    pod_job_label: str  # the label that selects the job's pods

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


TRAINJOB = Api("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob", "node", "jobset.sigs.k8s.io/jobset-name")
PYTORCHJOB = Api("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", "pytorch", "training.kubeflow.org/job-name")
APIS = {"trainjob": TRAINJOB, "pytorchjob": PYTORCHJOB}
RAYJOB = Api("ray.io", "v1", "rayjobs", "RayJob", "ray-head", "batch.kubernetes.io/job-name")
# An array job's pods (batch/v1 Indexed Job): their one container, and the label the Job controller gives them.
INDEXED_CONTAINER = "task"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_PREFIX, RAYJOB_PREFIX = "job/", "rayjob/"  # ids of an Indexed Job and of a RayJob (a bare name: training)
RAY_PORTS = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
             {"containerPort": 10001, "name": "client"}]
# Backwards-compatible names of the v1 API.
GROUP, VERSION, PLURAL, KIND = PYTORCHJOB.group, PYTORCHJOB.version, PYTORCHJOB.plural, PYTORCHJOB.kind
CONTAINER = PYTORCHJOB.container
JOB_LABEL = PYTORCHJOB.pod_job_label

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a Kueue WorkloadPriorityClass
PATCH_MANAGER = "pinflow.io/airflow"  # runtimePatches[].manager: a domain-prefixed path, as the Trainer requires
TRAINER_NODE_JOB = "node"
# Set by the Trainer's Torch ML policy; a TrainJob must not set them itself.
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TRAINER_PORT = 29500
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
# Pod phases and reasons that mean the node or the pod was taken away, not that the code failed.
LOST_REASONS = ("Evicted", "NodeLost", "Preempted", "Preempting", "DeadlineExceeded", "Terminated", "NodeShutdown",
                "DisruptionTarget", "UnexpectedAdmissionError")


# -- schemas -------------------------------------------------------------------------------------------------
def _structural(schema: Any) -> Any:
    """A CRD's OpenAPI schema as a JSON schema that rejects unknown fields (strict field validation)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = _structural(value) if isinstance(value, dict) else value
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [_structural(v) for v in value]
        elif not key.startswith(("x-pinflow", "$comment")):
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(name: str = "pytorchjob") -> dict[str, Any]:
    """The kept schema ``crds/<name>.json`` (trainjob, clustertrainingruntime, jobset, pytorchjob).

    An upstream schema kept whole (``x-pinflow-source``) rejects unknown fields; the PyTorchJob subset cannot
    (it leaves most of the pod spec out), so its pod templates go through the client's model instead.
    """
    schema = json.loads((CRD_DIR / f"{name}.json").read_text())
    return dict(_structural(schema)) if "x-pinflow-source" in schema else dict(schema)


def schema_errors(obj: dict[str, Any], name: str) -> list[str]:
    import jsonschema

    errors = sorted(jsonschema.Draft7Validator(crd_schema(name)).iter_errors(obj), key=lambda e: list(e.path))
    return [f"{'.'.join(str(p) for p in e.path) or '(top)'}: {e.message[:300]}" for e in errors]


def _check_schema(obj: dict[str, Any], name: str, what: str) -> None:
    errors = schema_errors(obj, name)
    if errors:
        raise ValueError(f"{what} breaks the {name} CRD schema: " + "; ".join(errors[:5]))


def check_pod_template(template: dict[str, Any], what: str) -> None:
    """Raise ValueError if a pod template has fields the kubernetes client's V1PodTemplateSpec does not know."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(template, "V1PodTemplateSpec")  # type: ignore[attr-defined]
    if api.sanitize_for_serialization(model) != template:
        raise ValueError(f"{what} has fields V1PodTemplateSpec does not know: {template}")


@functools.cache
def shipped_runtime() -> dict[str, Any]:
    """The ClusterTrainingRuntime of ``deploy/kubernetes/`` (what ``kubernetes.runtime`` names)."""
    return dict(yaml.safe_load(RUNTIME_FILE.read_text()))


def check_manifest(manifest: dict[str, Any], runtime: dict[str, Any] | None = None) -> None:
    """Raise ValueError if the manifest breaks its CRD schema or the rules its controller's webhook enforces."""
    kind = manifest.get("kind")
    if kind == "Job":
        check_indexed_job(manifest)
    elif kind == RAYJOB.kind:
        check_rayjob(manifest)
    elif kind == TRAINJOB.kind:
        _check_trainjob(manifest, runtime or shipped_runtime())
    elif kind == "ClusterTrainingRuntime":
        _check_runtime(manifest)
    elif kind == PYTORCHJOB.kind:
        _check_pytorchjob(manifest)
    else:
        raise ValueError(f"no schema kept for kind {kind!r}")


def check_indexed_job(manifest: dict[str, Any]) -> None:
    """Raise ValueError if a batch/v1 Job has fields the client's ``V1Job`` model does not know, or breaks the
    rules the Job API validates for an Indexed Job with per-index backoff and a pod failure policy."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(manifest, "V1Job")  # type: ignore[attr-defined]
    if api.sanitize_for_serialization(model) != manifest:
        raise ValueError(f"Job manifest has fields V1Job does not know: {manifest}")
    spec = manifest["spec"]
    pod = spec["template"]["spec"]
    problems = []
    if manifest.get("apiVersion") != "batch/v1":
        problems.append(f"apiVersion {manifest.get('apiVersion')!r} must be batch/v1")
    if not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", manifest["metadata"]["name"]):
        problems.append("metadata.name must be a DNS label of at most 63 characters")
    if spec.get("completionMode") != "Indexed" or not spec.get("completions"):
        problems.append("an array job is an Indexed Job with completions")
    if "backoffLimitPerIndex" in spec and spec.get("completionMode") != "Indexed":
        problems.append("backoffLimitPerIndex needs completionMode Indexed")
    if int(spec.get("maxFailedIndexes", 0)) > int(spec.get("completions", 0)):
        problems.append("maxFailedIndexes must be at most completions")
    if "podFailurePolicy" in spec:
        if pod.get("restartPolicy") != "Never":
            problems.append("a podFailurePolicy needs restartPolicy Never")
        if spec.get("podReplacementPolicy", "Failed") != "Failed":
            problems.append("a podFailurePolicy needs podReplacementPolicy Failed")
        for rule in spec["podFailurePolicy"]["rules"]:
            if rule["action"] == "FailIndex" and "backoffLimitPerIndex" not in spec:
                problems.append("the FailIndex action needs backoffLimitPerIndex")
    if problems:
        raise ValueError("Job manifest breaks the Job API's rules: " + "; ".join(problems))


def check_rayjob(manifest: dict[str, Any]) -> None:
    """Raise ValueError if a RayJob breaks the kept KubeRay CRD schema, or a pod template of its cluster has
    fields ``V1PodTemplateSpec`` does not know."""
    _check_schema(manifest, "rayjob", "RayJob manifest")
    cluster = manifest["spec"]["rayClusterSpec"]
    check_pod_template(cluster["headGroupSpec"]["template"], "RayJob head pod template")
    for group in cluster.get("workerGroupSpecs", []):
        check_pod_template(group["template"], f"RayJob worker group {group['groupName']}'s pod template")


def _check_pytorchjob(manifest: dict[str, Any]) -> None:
    _check_schema(manifest, "pytorchjob", "PyTorchJob manifest")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    if set(replicas) - {"Master", "Worker"} or "Master" not in replicas:
        raise ValueError(f"PyTorchJob replica types must be Master (+ Worker), not {sorted(replicas)}")
    for kind, replica in replicas.items():
        check_pod_template(replica["template"], f"{kind} pod template")


def _check_runtime(runtime: dict[str, Any]) -> None:
    _check_schema(runtime, "clustertrainingruntime", "ClusterTrainingRuntime")
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    trainer = [j for j in jobs if j.get("template", {}).get("metadata", {}).get("labels", {})
               .get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
    if len(trainer) != 1 or not any(c["name"] == TRAINJOB.container
                                    for c in trainer[0]["template"]["spec"]["template"]["spec"]["containers"]):
        raise ValueError("the runtime needs one replicated job labelled as the trainer step, with a container 'node'")
    for job in jobs:
        check_pod_template(job["template"]["spec"]["template"], f"runtime job {job['name']}'s pod template")


def _check_trainjob(manifest: dict[str, Any], runtime: dict[str, Any]) -> None:
    _check_schema(manifest, "trainjob", "TrainJob manifest")
    spec = manifest["spec"]
    problems = []
    reserved = sorted({e["name"] for e in spec.get("trainer", {}).get("env", [])} & set(TORCH_RESERVED_ENV))
    if reserved:
        problems.append(f"trainer.env must not set {reserved} (the Trainer's Torch policy sets them)")
    containers = {
        job["name"]: {c["name"] for c in job["template"]["spec"]["template"]["spec"].get("containers", [])}
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    for patch in spec.get("runtimePatches", []):
        if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.[a-z]{2,}/[A-Za-z0-9][-A-Za-z0-9_.]*$", patch["manager"]):
            problems.append(f"runtimePatches manager {patch['manager']!r} must be a domain-prefixed path")
        for job in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            if job["name"] not in containers:
                problems.append(f"runtimePatches name replicated job {job['name']!r}, not in the runtime")
                continue
            pod = job.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []):
                if c["name"] not in containers[job["name"]]:
                    problems.append(f"runtimePatches name container {c['name']!r}, not in runtime job {job['name']!r}")
                elif c.get("env") and c["name"] == TRAINJOB.container:
                    problems.append("runtimePatches must not set env of the node container (use trainer.env)")
    if problems:
        raise ValueError("TrainJob manifest breaks the Trainer's admission rules: " + "; ".join(problems))
    jobset = render_jobset(manifest, runtime)
    _check_schema(jobset, "jobset", "the JobSet the Trainer would create")
    for job in jobset["spec"]["replicatedJobs"]:
        check_pod_template(job["template"]["spec"]["template"], f"JobSet job {job['name']}'s pod template")


def _merge_named(base: list[dict[str, Any]], patch: list[dict[str, Any]], key: str = "name") -> list[dict[str, Any]]:
    merged = [copy.deepcopy(item) for item in base]
    for item in patch:
        found = next((m for m in merged if m.get(key) == item.get(key)), None)
        if found is None:
            merged.append(copy.deepcopy(item))
        else:
            found.update(_merge(found, item))
    return merged


_NAMED_LISTS = {"containers", "initContainers", "volumes", "volumeMounts", "env", "replicatedJobs"}


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic-merge-like patch: maps merge, lists of named items merge by name, other lists append."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_named(out[key], value) if key in _NAMED_LISTS else out[key] + copy.deepcopy(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render_jobset(trainjob: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The JobSet the Trainer would build from ``runtime`` for ``trainjob`` (its jobset and torch plugins, simplified).

    The trainer step's Job gets one replica and ``numNodes`` pods; its ``node`` container the TrainJob's image,
    command, args, env (then the ``PET_*`` variables), resources and the trainer port; then the runtime patches.
    """
    name = trainjob["metadata"]["name"]
    trainer = trainjob["spec"].get("trainer", {})
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    nodes = int(trainer.get("numNodes") or runtime["spec"].get("mlPolicy", {}).get("numNodes") or 1)
    for job in spec["replicatedJobs"]:
        labels = job.get("template", {}).get("metadata", {}).get("labels", {})
        if labels.get("trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
            continue
        job["replicas"] = 1
        job["template"]["spec"].update(parallelism=nodes, completions=nodes, completionMode="Indexed")
        for container in job["template"]["spec"]["template"]["spec"]["containers"]:
            if container["name"] != TRAINJOB.container:
                continue
            for key in ("image", "command", "args"):
                if key in trainer:
                    container[key] = list(trainer[key]) if isinstance(trainer[key], list) else trainer[key]
            if "resourcesPerNode" in trainer:
                container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
            pet: list[dict[str, Any]] = [
                {"name": "PET_NNODES", "value": str(nodes)},
                {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
                {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{TRAINER_NODE_JOB}-0-0.{name}"},
                {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
            ]
            container["env"] = _merge_named(container.get("env", []), [*trainer.get("env", []), *pet])
            container["ports"] = _merge_named(container.get("ports", []), [{"containerPort": TRAINER_PORT}],
                                              key="containerPort")
    for patch in trainjob["spec"].get("runtimePatches", []):
        spec = _merge(spec, patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}))
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": trainjob["metadata"].get("namespace", "default"),
                     "labels": dict(trainjob["metadata"].get("labels", {}))},
        "spec": spec,
    }


# -- the backend ---------------------------------------------------------------------------------------------
class KubernetesBackend:
    name = "kubernetes"

    @classmethod
    def from_config(cls, cfg: PlatformConfig, home: str | None = None) -> KubernetesBackend:
        return cls(cfg.kubernetes, cfg.teams, Catalog.from_config(cfg), ray_version=cfg.inference.ray_version)

    def __init__(
        self, options: KubernetesConfig | None = None, teams: Mapping[str, TeamConfig] | None = None,
        catalog: Catalog | None = None, ray_version: str = "2.60.0",
    ) -> None:
        self.options = options or KubernetesConfig()
        self.teams = dict(teams or {})
        self.catalog = catalog or Catalog.default()
        self.ray_version = ray_version  # a RayJob's rayVersion: the Ray of the image (inference.ray_version)
        self._hook: Any = None

    @property
    def namespace(self) -> str:
        return str(self.options.namespace)

    @property
    def api(self) -> Api:
        return APIS[self.options.api]

    # -- the request: pure ---------------------------------------------------------------------------------
    @staticmethod
    def resources(res: NodeResources) -> dict[str, dict[str, str]]:
        """Requests slightly below the limits for cpu and memory; extended resources and hugepages equal."""
        requests = {"cpu": milli_quantity(res.cpu_request_milli), "memory": mib_quantity(res.memory_request_mib)}
        limits = {"cpu": str(res.cpu_limit), "memory": mib_quantity(res.memory_limit_mib)}
        extended = {}
        if res.gpus:
            extended[GPU_RESOURCE] = str(res.gpus)
        if res.efa:
            extended[EFA_RESOURCE] = str(res.efa)
        if res.hugepages_2mi_mib:
            extended["hugepages-2Mi"] = mib_quantity(res.hugepages_2mi_mib)
        return {"requests": {**requests, **extended}, "limits": {**limits, **extended}}

    def _env(self, spec: JobSpec, res: NodeResources) -> list[dict[str, Any]]:
        env = {"PYTHONUNBUFFERED": "1", **(efa_environment(res, self.options.nccl_socket_ifname)
                                           if spec.distributed else {}), **spec.env}
        if spec.checkpoint_dir:
            env.setdefault("PINFLOW_CHECKPOINT_DIR", spec.checkpoint_dir)
        entries: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(env.items())]
        if self.options.checkpoint_key_secret:  # the checkpoint signing key, from a Secret: never in the spec
            name, key = self.options.checkpoint_key_secret.split("/", 1)
            entries.append({"name": "PINFLOW_CHECKPOINT_KEY",
                            "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
        return entries

    def _pod_extras(self, res: NodeResources) -> dict[str, Any]:
        """What the pod spec gets from the instance type: node selector, tolerations, /dev/shm, service account."""
        pod: dict[str, Any] = {"nodeSelector": {K8S_INSTANCE_TYPE: res.instance_type}}
        if res.gpus:
            pod["tolerations"] = [dict(GPU_TOLERATION)]
        if self.options.service_account:
            pod["serviceAccountName"] = self.options.service_account
        # NCCL and DataLoader workers need far more than the runtime's 64 MB /dev/shm; memory-backed, it is
        # charged to the container's memory, so it stays inside the limit.
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": mib_quantity(res.shm_mib)}}]
        return pod

    def _labels(self, spec: JobSpec, res: NodeResources, team: TeamConfig) -> dict[str, str]:
        labels = {QUEUE_LABEL: team.queue, "pinflow/team": spec.team, "pinflow/job": spec.name,
                  "pinflow/instance-type": res.instance_type}
        if team.priority_class:
            labels[PRIORITY_LABEL] = team.priority_class
        return labels

    def trainjob(self, spec: JobSpec, res: NodeResources, team: TeamConfig) -> dict[str, Any]:
        pod = self._pod_extras(res)
        pod["containers"] = [{"name": TRAINJOB.container, "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]
        trainer: dict[str, Any] = {
            "image": res.image,
            "command": launch_command(spec),
            "numNodes": spec.nodes,
            "resourcesPerNode": self.resources(res),
            "env": self._env(spec, res),
        }
        if spec.distributed:
            trainer["numProcPerNode"] = spec.procs_per_node
        return {
            "apiVersion": TRAINJOB.api_version,
            "kind": TRAINJOB.kind,
            "metadata": {"name": spec.name, "namespace": self.namespace, "labels": self._labels(spec, res, team)},
            "spec": {
                "runtimeRef": {"name": self.options.runtime, "apiGroup": TRAINJOB.group, "kind": "ClusterTrainingRuntime"},
                "activeDeadlineSeconds": spec.timeout_s,
                "trainer": trainer,
                "runtimePatches": [{
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                        "name": TRAINER_NODE_JOB,
                        "template": {"spec": {"template": {
                            "metadata": {"labels": {"pinflow/team": spec.team, "pinflow/job": spec.name}},
                            "spec": pod,
                        }}},
                    }]}}},
                }],
            },
        }

    def pytorchjob(self, spec: JobSpec, res: NodeResources, team: TeamConfig) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": PYTORCHJOB.container,
            "image": res.image,
            "command": launch_command(spec),
            "env": self._env(spec, res),
            "ports": [{"containerPort": int(self.options.rdzv_port), "name": "pytorchjob-port"}],
            "resources": self.resources(res),
            "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
        }
        pod: dict[str, Any] = {"containers": [container], "restartPolicy": "Never", **self._pod_extras(res)}
        if team.priority_class:
            pod["priorityClassName"] = team.priority_class
        template = {"metadata": {"labels": {"pinflow/team": spec.team, "pinflow/job": spec.name}}, "spec": pod}
        replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
        if spec.distributed and spec.nodes > 1:
            replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "Never", "template": template}
        labels = self._labels(spec, res, team)
        labels.pop(PRIORITY_LABEL, None)  # v1: the pods' PriorityClass
        return {
            "apiVersion": PYTORCHJOB.api_version,
            "kind": PYTORCHJOB.kind,
            "metadata": {"name": spec.name, "namespace": self.namespace, "labels": labels},
            "spec": {
                "nprocPerNode": str(spec.procs_per_node),
                "pytorchReplicaSpecs": replicas,
                "runPolicy": {
                    # Pods are never restarted by the operator: a retry is Airflow's, from the last checkpoint.
                    "backoffLimit": 0,
                    "activeDeadlineSeconds": spec.timeout_s,
                    # Pods still running when the job ends are deleted (their GPUs freed); ended ones are kept
                    # for their logs and exit codes until the TTL.
                    "cleanPodPolicy": "Running",
                    "ttlSecondsAfterFinished": int(self.options.ttl_seconds_after_finished),
                },
            },
        }

    def _pod(self, res: NodeResources, team: TeamConfig, containers: list[dict[str, Any]]) -> dict[str, Any]:
        pod: dict[str, Any] = {"containers": containers, "restartPolicy": "Never", **self._pod_extras(res)}
        if team.priority_class:
            pod["priorityClassName"] = team.priority_class
        return pod

    def indexed_job(self, spec: JobSpec, res: NodeResources, team: TeamConfig) -> dict[str, Any]:
        """An array job as a batch/v1 Indexed Job: one pod per index (``JOB_COMPLETION_INDEX``), ``parallelism``
        at a time, a failed index left failed (no in-cluster retry: Airflow's retry runs what is missing)."""
        container = {
            "name": INDEXED_CONTAINER,
            "image": res.image,
            "command": launch_command(spec),
            "env": self._env(spec, res),
            "resources": self.resources(res),
            "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
        }
        pod = self._pod(res, team, [container])
        pod["activeDeadlineSeconds"] = spec.timeout_s  # each index's own limit, however many waves the job takes
        size = spec.array_size
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": spec.name, "namespace": self.namespace, "labels": self._labels(spec, res, team)},
            "spec": {
                "completionMode": "Indexed",
                "completions": size,
                "parallelism": min(size, spec.array_parallelism or size),
                "backoffLimitPerIndex": 0,
                "maxFailedIndexes": size,
                "podFailurePolicy": {"rules": [
                    # Evicted, preempted, its node drained: the pod is replaced, the index not counted as failed.
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]},
                "podReplacementPolicy": "Failed",
                "suspend": True,  # Kueue admits the whole job when the team's quota has room
                "ttlSecondsAfterFinished": int(self.options.ttl_seconds_after_finished),
                "template": {"metadata": {"labels": {"pinflow/team": spec.team, "pinflow/job": spec.name}},
                             "spec": pod},
            },
        }

    def rayjob(self, spec: JobSpec, res: NodeResources, team: TeamConfig) -> dict[str, Any]:
        """A Ray job as a KubeRay RayJob: a head and ``spec.ray_workers`` workers of the instance type (every
        pod the whole node), the driver submitted by KubeRay, the cluster deleted when it ends; no retry inside."""
        env = self._env(spec, res)

        def template(name: str) -> dict[str, Any]:
            container = {"name": name, "image": res.image, "env": env, "resources": self.resources(res),
                         "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}]}
            if name == RAYJOB.container:
                container["ports"] = [dict(port) for port in RAY_PORTS]
            pod = {"containers": [container], **self._pod_extras(res)}
            if team.priority_class:
                pod["priorityClassName"] = team.priority_class
            return {"metadata": {"labels": {"pinflow/team": spec.team, "pinflow/job": spec.name}}, "spec": pod}

        # With workers, the head only runs the driver (and Ray's own services): no tasks or actors there.
        head_params = {"dashboard-host": "0.0.0.0", **({"num-cpus": "0"} if spec.ray_workers else {})}
        cluster: dict[str, Any] = {
            "rayVersion": self.ray_version,
            "headGroupSpec": {"rayStartParams": head_params, "template": template(RAYJOB.container)},
        }
        if spec.ray_workers:
            cluster["workerGroupSpecs"] = [{
                "groupName": "scorers", "replicas": spec.ray_workers, "minReplicas": spec.ray_workers,
                "maxReplicas": spec.ray_workers, "rayStartParams": {}, "template": template("ray-worker"),
            }]
        return {
            "apiVersion": RAYJOB.api_version,
            "kind": RAYJOB.kind,
            "metadata": {"name": spec.name, "namespace": self.namespace, "labels": self._labels(spec, res, team)},
            "spec": {
                "entrypoint": shlex.join(launch_command(spec)),
                "activeDeadlineSeconds": spec.timeout_s,
                "backoffLimit": 0,  # a retry is Airflow's: it scores what is still missing
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": int(self.options.ttl_seconds_after_finished),
                "suspend": True,  # Kueue admits the cluster when the team's quota has room for all of it
                "rayClusterSpec": cluster,
            },
        }

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """The whole manifest (TrainJob or PyTorchJob; an Indexed Job for an array, a RayJob for a Ray job),
        checked against the kept CRD schemas or the client's models."""
        validate_for(spec, self.teams, backend=self.name)
        reserved = sorted(set(spec.env) & set(TORCH_RESERVED_ENV))
        if reserved:
            raise ConfigError(f"job spec {spec.name!r}: env must not set {reserved} (the Trainer sets them)")
        spec, res = resolve(spec, self.teams, self.catalog)
        team = self.teams[spec.team]
        if spec.engine == "ray":
            manifest = self.rayjob(spec, res, team)
        elif spec.array_size:
            manifest = self.indexed_job(spec, res, team)
        elif self.api is TRAINJOB:
            manifest = self.trainjob(spec, res, team)
        else:
            manifest = self.pytorchjob(spec, res, team)
        check_manifest(manifest)
        return manifest

    # -- the service ---------------------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        if self._hook is None:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            self._hook = KubernetesHook(conn_id=self.options.conn_id)
        return self._hook

    def ping(self) -> None:
        self.hook.core_v1_client.list_namespaced_pod(self.namespace, limit=1)

    def _get(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        api = self.api
        try:
            return dict(self.hook.get_custom_object(api.group, api.version, api.plural, name, namespace=self.namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def _get_job(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            job = self.hook.batch_v1_client.read_namespaced_job(name=name, namespace=self.namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(self.hook.api_client.sanitize_for_serialization(job))

    def _get_rayjob(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(self.hook.get_custom_object(RAYJOB.group, RAYJOB.version, RAYJOB.plural, name,
                                                    namespace=self.namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def find(self, job_name: str) -> str | None:
        """The id of a training job of that name (an Indexed Job's or a RayJob's: :meth:`submit` again, which
        reattaches to the existing one)."""
        return job_name if self._get(job_name) is not None else None

    def submit(self, spec: JobSpec) -> str:
        from kubernetes.client.exceptions import ApiException

        manifest = self.dry_run(spec)
        api = self.api
        try:
            if manifest["kind"] == "Job":
                self.hook.batch_v1_client.create_namespaced_job(namespace=self.namespace, body=manifest)
            elif manifest["kind"] == RAYJOB.kind:
                self.hook.create_custom_object(RAYJOB.group, RAYJOB.version, RAYJOB.plural, manifest,
                                               namespace=self.namespace)
            else:
                self.hook.create_custom_object(api.group, api.version, api.plural, manifest, namespace=self.namespace)
        except ApiException as err:
            if err.status != 409:
                raise
            # Already exists: this task try submitted it before its worker died. Reattach.
        prefix = {"Job": JOB_PREFIX, RAYJOB.kind: RAYJOB_PREFIX}.get(manifest["kind"], "")
        return prefix + spec.name

    def pods(self, job_id: str) -> list[dict[str, Any]]:
        listing = self.hook.core_v1_client.list_namespaced_pod(
            self.namespace, label_selector=f"{self.api.pod_job_label}={job_id}"
        )
        return [dict(p) for p in self.hook.api_client.sanitize_for_serialization(listing).get("items", [])]

    def _pods_of(self, selector: str) -> list[dict[str, Any]]:
        listing = self.hook.core_v1_client.list_namespaced_pod(self.namespace, label_selector=selector)
        return [dict(p) for p in self.hook.api_client.sanitize_for_serialization(listing).get("items", [])]

    def status(self, job_id: str) -> JobStatus:
        if job_id.startswith(JOB_PREFIX):
            name = job_id.removeprefix(JOB_PREFIX)
            indexed = self._get_job(name)
            if indexed is None:
                return JobStatus(job_id, JobState.FAILED, FailureClass.INFRA,
                                 f"Job {self.namespace}/{name} is gone (deleted or garbage-collected)")
            failed = indexed_job_state(indexed)[0] is JobState.FAILED
            return classify_indexed_job(indexed, self._pods_of(f"{JOB_NAME_LABEL}={name}") if failed else [])
        if job_id.startswith(RAYJOB_PREFIX):
            name = job_id.removeprefix(RAYJOB_PREFIX)
            ray_job = self._get_rayjob(name)
            if ray_job is None:
                return JobStatus(job_id, JobState.FAILED, FailureClass.INFRA,
                                 f"RayJob {self.namespace}/{name} is gone (deleted or garbage-collected)")
            return classify_rayjob(ray_job)
        job = self._get(job_id)
        if job is None:
            return JobStatus(job_id, JobState.FAILED, FailureClass.INFRA,
                             f"{self.api.kind} {self.namespace}/{job_id} is gone (deleted or garbage-collected)")
        if self.api is TRAINJOB:
            state, _ = trainjob_state(job)
            return classify_trainjob(job, self.pods(job_id) if state is JobState.FAILED else [])
        state = job_state(job)
        return classify_pytorchjob(job, self.pods(job_id) if state is JobState.FAILED else [])

    def logs(self, job_id: str, tail: int = 50) -> str:
        if job_id.startswith((JOB_PREFIX, RAYJOB_PREFIX)):
            # An Indexed Job's failed pods first (at most five), or the RayJob's submitter (it tails the driver).
            name = job_id.split("/", 1)[1]
            pods = self._pods_of(f"{JOB_NAME_LABEL}={name}")
            pods.sort(key=lambda p: (p.get("status") or {}).get("phase") != "Failed")
            container = INDEXED_CONTAINER if job_id.startswith(JOB_PREFIX) else None
            targets = [(p["metadata"]["name"], container) for p in pods[:5]]
        else:
            targets = [(p["metadata"]["name"], self.api.container) for p in self.pods(job_id)]
        parts = []
        for name, container in targets:
            kwargs = {"container": container} if container else {}
            text = self.hook.core_v1_client.read_namespaced_pod_log(name, self.namespace, tail_lines=tail, **kwargs)
            parts.append(f"--- pod {name} ---\n{text}")
        return "\n".join(parts)

    def cancel(self, job_id: str) -> None:
        from kubernetes.client.exceptions import ApiException

        api = self.api
        try:
            if job_id.startswith(JOB_PREFIX):
                self.hook.batch_v1_client.delete_namespaced_job(job_id.removeprefix(JOB_PREFIX), self.namespace,
                                                                propagation_policy="Foreground")
            elif job_id.startswith(RAYJOB_PREFIX):
                self.hook.delete_custom_object(RAYJOB.group, RAYJOB.version, RAYJOB.plural,
                                               job_id.removeprefix(RAYJOB_PREFIX), namespace=self.namespace,
                                               propagation_policy="Foreground")
            else:
                self.hook.delete_custom_object(api.group, api.version, api.plural, job_id, namespace=self.namespace,
                                               propagation_policy="Foreground")
        except ApiException as err:
            if err.status != 404:
                raise

    def console_url(self, job_id: str) -> str:
        if job_id.startswith(JOB_PREFIX):
            plural, group = "jobs", "batch"
        elif job_id.startswith(RAYJOB_PREFIX):
            plural, group = RAYJOB.plural, RAYJOB.group
        else:
            plural, group = self.api.plural, self.api.group
        return str(self.options.console_url).format(namespace=self.namespace, name=job_id.split("/")[-1],
                                                    plural=plural, group=group)


# -- states and failure classes ------------------------------------------------------------------------------
def _timestamp(value: Any) -> float | None:
    if not value:
        return None
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _true_conditions(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(c.get("type")): c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def job_state(job: dict[str, Any]) -> JobState:
    """A PyTorchJob's state from its conditions."""
    kinds = set(_true_conditions(job))
    if "Succeeded" in kinds:
        return JobState.SUCCEEDED
    if "Failed" in kinds:
        return JobState.FAILED
    if "Running" in kinds or "Restarting" in kinds:
        return JobState.RUNNING
    return JobState.PENDING


def trainjob_state(job: dict[str, Any]) -> tuple[JobState, str]:
    """A TrainJob's state and, while PENDING, why: held by Kueue (suspended), or its pods not all running yet.

    RUNNING only when every replicated job has all its pods ready (``jobsStatus[].ready``): a job whose nodes
    are still scheduling or pulling their image is queued, not running, and its stall clock has not started.
    """
    conditions = _true_conditions(job)
    if "Complete" in conditions:
        return JobState.SUCCEEDED, ""
    if "Failed" in conditions:
        return JobState.FAILED, ""
    if "Suspended" in conditions:
        return JobState.PENDING, f"suspended: {conditions['Suspended'].get('message') or 'waiting for admission'}"
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    if jobs and all(int(j.get("ready", 0)) + int(j.get("succeeded", 0)) >= 1 for j in jobs):
        return JobState.RUNNING, ""
    return JobState.PENDING, "pods not all running yet (scheduling, pulling the image)"


def _pod_findings(pods: list[dict[str, Any]], container: str) -> tuple[dict[str, int | None], list[Finding]]:
    """Exit codes and findings of a failed job's pods: disruption INFRA, OOMKilled OOM, else the exit code's class."""
    codes: dict[str, int | None] = {}
    found: list[Finding] = []
    for pod in pods:
        pod_name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status") or {}
        terminated = next(
            ((cs.get("state") or {}).get("terminated") or {} for cs in status.get("containerStatuses") or []
             if cs.get("name") == container),
            {},
        )
        code = terminated.get("exitCode")
        codes[pod_name] = code
        disrupted = [c for c in status.get("conditions") or [] if c.get("type") == "DisruptionTarget"
                     and c.get("status") == "True"]
        pod_reason = status.get("reason") or (disrupted[0].get("reason") if disrupted else "")
        if pod_reason and any(r in pod_reason for r in LOST_REASONS) or disrupted:
            found.append(Finding(FailureClass.INFRA, f"pod {pod_name}: {pod_reason or 'disrupted'} (node or pod lost)",
                                 node_lost=True))
        elif terminated.get("reason") == "OOMKilled":
            found.append(Finding(FailureClass.OOM, f"pod {pod_name}: OOMKilled"))
        elif code not in (None, 0) and terminated.get("signal") == 9:
            found.append(Finding(FailureClass.INFRA, f"pod {pod_name} was killed by SIGKILL (not OOMKilled)"))
        elif code not in (None, 0):
            klass = classify_exit_code(int(code)) or FailureClass.USER
            found.append(Finding(klass, f"pod {pod_name} exited with code {code}"))
    return codes, found


def classify_pytorchjob(job: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> JobStatus:
    """A PyTorchJob (and its pods, as dicts) as a :class:`JobStatus`; pure, for recorded objects.

    A pod evicted, preempted or on a lost node is INFRA; a container OOMKilled is OOM; otherwise the exit
    code of the ``pytorch`` container names the class, and a code that names one beats a peer's INFRA.
    """
    name = str(job.get("metadata", {}).get("name", "?"))
    created = _timestamp(job.get("metadata", {}).get("creationTimestamp"))
    started = _timestamp((job.get("status") or {}).get("startTime"))
    state = job_state(job)
    if state is not JobState.FAILED:
        return JobStatus(name, state, created_at=created, started_at=started if state is not JobState.PENDING else None)
    failed = [c for c in job.get("status", {}).get("conditions", []) if c.get("type") == "Failed"]
    reason = f"{failed[-1].get('reason', '')}: {failed[-1].get('message', '')}" if failed else "Failed"
    codes, found = _pod_findings(pods or [], PYTORCHJOB.container)
    decided = decide(found)
    if decided is not None:
        klass, message = decided.failure_class, decided.message
    elif "DeadlineExceeded" in reason:
        klass, message = FailureClass.INFRA, reason
    else:
        klass, message = FailureClass.INFRA, f"{reason} (no pod says why: taken as infrastructure)"
    return JobStatus(name, JobState.FAILED, klass, f"PyTorchJob {name} failed: {message}", codes,
                     created_at=created, started_at=started)


def classify_trainjob(job: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> JobStatus:
    """A TrainJob (and its pods, as dicts) as a :class:`JobStatus`; pure, for recorded objects.

    As :func:`classify_pytorchjob` for the ``node`` container; without pods to ask, a failure by the pod
    failure policy is the USER/DATA rule of the runtime, a deadline INFRA, anything else INFRA.
    """
    name = str(job.get("metadata", {}).get("name", "?"))
    created = _timestamp(job.get("metadata", {}).get("creationTimestamp"))
    state, why = trainjob_state(job)
    if state is not JobState.FAILED:
        return JobStatus(name, state, reason=why, created_at=created)
    failed = _true_conditions(job)["Failed"]
    reason = f"{failed.get('reason', '')}: {failed.get('message', '')}"
    codes, found = _pod_findings(pods or [], TRAINJOB.container)
    decided = decide(found)
    if decided is not None:
        klass, message = decided.failure_class, decided.message
    elif "DeadlineExceeded" in reason:
        klass, message = FailureClass.INFRA, reason
    elif "PodFailurePolicy" in reason:
        klass, message = FailureClass.USER, f"{reason} (a node exited with a USER or DATA code; its pod is gone)"
    else:
        klass, message = FailureClass.INFRA, f"{reason} (no pod says why: taken as infrastructure)"
    return JobStatus(name, JobState.FAILED, klass, f"TrainJob {name} failed: {message}", codes, created_at=created)


def indexed_job_state(job: dict[str, Any]) -> tuple[JobState, str]:
    """An Indexed Job's state: held by Kueue (suspended) or no pod started yet: PENDING; then RUNNING until its
    ``Complete`` or ``Failed`` condition (with per-index backoff: once every index has ended)."""
    conditions = _true_conditions(job)
    if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
        return JobState.SUCCEEDED, ""
    if "Failed" in conditions or "FailureTarget" in conditions:
        return JobState.FAILED, ""
    if "Suspended" in conditions or (job.get("spec") or {}).get("suspend"):
        return JobState.PENDING, "suspended: waiting for admission (Kueue)"
    status = job.get("status") or {}
    if any(int(status.get(k) or 0) for k in ("ready", "succeeded", "failed")):
        return JobState.RUNNING, ""
    return JobState.PENDING, "pods not running yet (scheduling, pulling the image)"


def classify_indexed_job(job: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> JobStatus:
    """An Indexed Job (and its pods, as dicts) as a :class:`JobStatus`; pure, for recorded objects.

    A failed one takes the class of its failed pods' ``task`` containers by the precedence rule (a disrupted pod
    or a lost node INFRA, OOMKilled OOM, a SIGKILL INFRA, else the exit code's class); the reason names the
    failed indexes (``status.failedIndexes``).
    """
    name = str(job.get("metadata", {}).get("name", "?"))
    job_id = JOB_PREFIX + name
    created = _timestamp(job.get("metadata", {}).get("creationTimestamp"))
    started = _timestamp((job.get("status") or {}).get("startTime"))
    state, why = indexed_job_state(job)
    if state is not JobState.FAILED:
        return JobStatus(job_id, state, reason=why, created_at=created,
                         started_at=started if state is not JobState.PENDING else None)
    status = job.get("status") or {}
    failed = {**_true_conditions(job).get("FailureTarget", {}), **_true_conditions(job).get("Failed", {})}
    reason = f"{failed.get('reason', '')}: {failed.get('message', '')}"
    failed_pods = [p for p in pods or [] if (p.get("status") or {}).get("phase") == "Failed"]
    codes, found = _pod_findings(failed_pods, INDEXED_CONTAINER)
    decided = decide(found)
    if decided is not None:
        klass, message = decided.failure_class, decided.message
    elif "DeadlineExceeded" in reason:
        klass, message = FailureClass.INFRA, reason
    else:
        klass, message = FailureClass.INFRA, f"{reason} (no pod says why: taken as infrastructure)"
    detail = (f"Job {name} failed: indexes {status.get('failedIndexes') or '?'} failed, "
              f"{status.get('succeeded', 0)} of {job.get('spec', {}).get('completions', '?')} succeeded; {message}")
    return JobStatus(job_id, JobState.FAILED, klass, detail, codes, created_at=created, started_at=started,
                     ended_at=_timestamp(status.get("completionTime")))


def classify_rayjob(job: dict[str, Any]) -> JobStatus:
    """A KubeRay RayJob as a :class:`JobStatus`; pure, for recorded objects.

    Suspended (Kueue), ``New`` or ``Initializing`` (the cluster coming up) is PENDING; then RUNNING until
    ``jobDeploymentStatus`` is ``Complete`` (SUCCEEDED if the Ray job's status is) or ``Failed``. A failed driver's
    exit code (``... exit code N`` in the message) names the class; a deadline, a cluster that never came up, a
    submission that failed or anything unexplained is INFRA.
    """
    name = str(job.get("metadata", {}).get("name", "?"))
    job_id = RAYJOB_PREFIX + name
    status = job.get("status") or {}
    created = _timestamp(job.get("metadata", {}).get("creationTimestamp"))
    started = _timestamp(status.get("startTime"))
    deployment = str(status.get("jobDeploymentStatus") or "")
    ray_status = str(status.get("jobStatus") or "")
    if deployment == "Complete" and ray_status == "SUCCEEDED":
        return JobStatus(job_id, JobState.SUCCEEDED, created_at=created, started_at=started,
                         ended_at=_timestamp(status.get("endTime")))
    if deployment in ("Complete", "Failed") or ray_status in ("FAILED", "STOPPED"):
        reason = str(status.get("reason") or "")
        message = str(status.get("message") or "")
        code = re.search(r"exit code (-?\d+)", message)
        if reason == "AppFailed" and code:
            klass = classify_exit_code(int(code.group(1))) or FailureClass.USER
        else:
            klass = FailureClass.INFRA
        text = f"RayJob {name} failed ({reason or deployment}, Ray job {ray_status or 'not started'}): {message[-2000:]}"
        return JobStatus(job_id, JobState.FAILED, klass, text, {}, created_at=created, started_at=started,
                         ended_at=_timestamp(status.get("endTime")))
    if deployment in ("Running", "Retrying") and ray_status in ("RUNNING", "PENDING", ""):
        return JobStatus(job_id, JobState.RUNNING, reason=ray_status, created_at=created, started_at=started)
    return JobStatus(job_id, JobState.PENDING, reason=f"{deployment or 'New'}: the Ray cluster is not up yet"
                     + (" (suspended: waiting for admission)" if job.get("spec", {}).get("suspend") else ""),
                     created_at=created)
