"""Kubeflow ``PyTorchJob``s through the cncf.kubernetes provider's hook.

The manifest is built by a pure function (:meth:`KubernetesBackend.dry_run`) and checked before it is
sent: against the PyTorchJob CRD schema kept in ``crds/pytorchjob.json`` and, for each replica's pod
template, through the kubernetes client's ``V1PodTemplateSpec`` model (a misspelt field does not survive
the round trip). One ``Master`` and ``nodes - 1`` ``Worker`` replicas each run ``python -m
training.launch``, which reads the rendezvous the training operator sets (``MASTER_ADDR``,
``MASTER_PORT``, ``PET_NNODES``, ``PET_NODE_RANK``). The team's Kueue ``LocalQueue`` is a label on the
job; its priority class goes on the pods. The job's name is its id: creating it twice answers 409, and
the backend reattaches to the existing job.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.config import KubernetesConfig, TeamConfig
from core.failures import FailureClass, Finding, classify_exit_code, decide
from operators.backends.base import JobSpec, JobState, JobStatus, launch_command, validate_for

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CRD_FILE = Path(__file__).with_name("crds") / "pytorchjob.json"
CONTAINER = "pytorch"  # the training operator finds the container by this name
JOB_LABEL = "training.kubeflow.org/job-name"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Pod phases and reasons that mean the node or the pod was taken away, not that the code failed.
LOST_REASONS = ("Evicted", "NodeLost", "Preempted", "Preempting", "DeadlineExceeded", "Terminated", "NodeShutdown",
                "DisruptionTarget", "UnexpectedAdmissionError")




@functools.cache
def crd_schema() -> dict[str, Any]:
    return dict(json.loads(CRD_FILE.read_text()))


def check_manifest(manifest: dict[str, Any]) -> None:
    """Raise ValueError if the manifest breaks the CRD schema or a pod template is not a V1PodTemplateSpec."""
    import jsonschema
    from kubernetes.client import ApiClient

    errors = sorted(jsonschema.Draft7Validator(crd_schema()).iter_errors(manifest), key=lambda e: list(e.path))
    if errors:
        raise ValueError("PyTorchJob manifest breaks the CRD schema: " + "; ".join(
            f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in errors[:5]))
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    if set(replicas) - {"Master", "Worker"} or "Master" not in replicas:
        raise ValueError(f"PyTorchJob replica types must be Master (+ Worker), not {sorted(replicas)}")
    api = ApiClient()
    for kind, replica in replicas.items():
        template = replica["template"]
        model = api._ApiClient__deserialize(template, "V1PodTemplateSpec")  # type: ignore[attr-defined]
        if api.sanitize_for_serialization(model) != template:
            raise ValueError(f"{kind} pod template has fields V1PodTemplateSpec does not know: {template}")


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, options: KubernetesConfig | None = None, teams: Mapping[str, TeamConfig] | None = None) -> None:
        self.options = options or KubernetesConfig()
        self.teams = dict(teams or {})
        self._hook: Any = None

    @property
    def namespace(self) -> str:
        return str(self.options.namespace)

    # -- the request: pure ---------------------------------------------------------------------------------
    def _pod_template(self, spec: JobSpec, team: TeamConfig) -> dict[str, Any]:
        opts = self.options
        resources: dict[str, str] = {"cpu": str(spec.cpus_per_node), "memory": f"{spec.memory_gb_per_node}Gi"}
        limits = dict(resources)
        if spec.gpus_per_node:
            limits["nvidia.com/gpu"] = str(spec.gpus_per_node)
        if opts.efa_devices:
            limits["vpc.amazonaws.com/efa"] = str(opts.efa_devices)
        command = launch_command(spec)
        env = {"PYTHONUNBUFFERED": "1", **spec.env}
        if spec.checkpoint_dir:
            env.setdefault("PINFLOW_CHECKPOINT_DIR", spec.checkpoint_dir)
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": spec.image,
            "command": command,
            "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
            "ports": [{"containerPort": int(opts.rdzv_port), "name": "pytorchjob-port"}],
            "resources": {"requests": resources, "limits": limits},
            "volumeMounts": [{"mountPath": "/dev/shm", "name": "dshm"}],
        }
        pod: dict[str, Any] = {
            "containers": [container],
            # NCCL and DataLoader workers need far more than the container runtime's 64 MB /dev/shm.
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}],
            "restartPolicy": "Never",
        }
        if team.priority_class:
            pod["priorityClassName"] = team.priority_class
        if opts.service_account:
            pod["serviceAccountName"] = opts.service_account
        if spec.gpus_per_node:
            pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        return {"metadata": {"labels": {"pinflow/team": spec.team, "pinflow/job": spec.name}}, "spec": pod}

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """The whole PyTorchJob manifest, checked against the CRD schema and the pod template model."""
        validate_for(spec, self.teams, max_gpus_per_node=int(self.options.max_gpus_per_node), backend=self.name)
        team = self.teams[spec.team]
        template = self._pod_template(spec, team)
        replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
        if spec.distributed and spec.nodes > 1:
            replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "Never", "template": template}
        manifest: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {
                "name": spec.name,
                "namespace": self.namespace,
                "labels": {QUEUE_LABEL: team.queue, "pinflow/team": spec.team},
            },
            "spec": {
                "nprocPerNode": str(spec.procs_per_node),
                "pytorchReplicaSpecs": replicas,
                "runPolicy": {
                    # Pods are never restarted by the operator: a retry is Airflow's, from the last checkpoint.
                    "backoffLimit": 0,
                    "activeDeadlineSeconds": spec.timeout_s,
                    "cleanPodPolicy": "None",  # keep finished pods for their logs and exit codes
                    "ttlSecondsAfterFinished": int(self.options.ttl_seconds_after_finished),
                },
            },
        }
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

        try:
            return dict(self.hook.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=self.namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def find(self, job_name: str) -> str | None:
        return job_name if self._get(job_name) is not None else None

    def submit(self, spec: JobSpec) -> str:
        from kubernetes.client.exceptions import ApiException

        manifest = self.dry_run(spec)
        try:
            self.hook.create_custom_object(GROUP, VERSION, PLURAL, manifest, namespace=self.namespace)
        except ApiException as err:
            if err.status != 409:
                raise
            # Already exists: this task try submitted it before its worker died. Reattach.
        return spec.name

    def pods(self, job_id: str) -> list[dict[str, Any]]:
        listing = self.hook.core_v1_client.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={job_id}")
        return [dict(p) for p in self.hook.api_client.sanitize_for_serialization(listing).get("items", [])]

    def status(self, job_id: str) -> JobStatus:
        job = self._get(job_id)
        if job is None:
            return JobStatus(job_id, JobState.FAILED, FailureClass.INFRA,
                             f"PyTorchJob {self.namespace}/{job_id} is gone (deleted or garbage-collected)")
        state = job_state(job)
        pods = self.pods(job_id) if state is JobState.FAILED else []
        return classify_pytorchjob(job, pods)

    def logs(self, job_id: str, tail: int = 50) -> str:
        parts = []
        for pod in self.pods(job_id):
            name = pod["metadata"]["name"]
            text = self.hook.core_v1_client.read_namespaced_pod_log(
                name, self.namespace, container=CONTAINER, tail_lines=tail
            )
            parts.append(f"--- pod {name} ---\n{text}")
        return "\n".join(parts)

    def cancel(self, job_id: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.hook.delete_custom_object(GROUP, VERSION, PLURAL, job_id, namespace=self.namespace,
                                           propagation_policy="Foreground")
        except ApiException as err:
            if err.status != 404:
                raise

    def console_url(self, job_id: str) -> str:
        return str(self.options.console_url).format(namespace=self.namespace, name=job_id)


def job_state(job: dict[str, Any]) -> JobState:
    """The state from the job's conditions: the last condition whose status is True."""
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    kinds = {c.get("type") for c in conditions}
    if "Succeeded" in kinds:
        return JobState.SUCCEEDED
    if "Failed" in kinds:
        return JobState.FAILED
    if "Running" in kinds or "Restarting" in kinds:
        return JobState.RUNNING
    return JobState.PENDING


def classify_pytorchjob(job: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> JobStatus:
    """A PyTorchJob (and its pods, as dicts) as a :class:`JobStatus`; pure, for recorded objects.

    A pod evicted, preempted or on a lost node is INFRA; a container OOMKilled is OOM; otherwise the exit
    code of the ``pytorch`` container names the class, and a code that names one beats a peer's INFRA.
    """
    name = str(job.get("metadata", {}).get("name", "?"))
    state = job_state(job)
    if state is not JobState.FAILED:
        return JobStatus(name, state)
    failed = [c for c in job.get("status", {}).get("conditions", []) if c.get("type") == "Failed"]
    reason = f"{failed[-1].get('reason', '')}: {failed[-1].get('message', '')}" if failed else "Failed"
    codes: dict[str, int | None] = {}
    found: list[Finding] = []
    for pod in pods or []:
        pod_name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status") or {}
        terminated = next(
            ((cs.get("state") or {}).get("terminated") or {} for cs in status.get("containerStatuses") or []
             if cs.get("name") == CONTAINER),
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
        elif code not in (None, 0):
            klass = classify_exit_code(int(code)) or FailureClass.USER
            found.append(Finding(klass, f"pod {pod_name} exited with code {code}"))
    decided = decide(found)
    if decided is not None:
        klass, message = decided.failure_class, decided.message
    elif "DeadlineExceeded" in reason:
        klass, message = FailureClass.INFRA, reason
    else:
        klass, message = FailureClass.INFRA, f"{reason} (no pod says why: taken as infrastructure)"
    return JobStatus(name, JobState.FAILED, klass, f"PyTorchJob {name} failed: {message}", codes)
