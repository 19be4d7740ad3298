"""AWS Batch multi-node parallel jobs through the Amazon provider's hooks.

The request is built by a pure function (:meth:`BatchBackend.dry_run`): a job definition whose name carries
a digest of its content (registered once, reused by every job with the same image and resources) and a
``submit_job`` call with ``nodeOverrides`` (command, environment), a timeout and tags. Every node runs
``python -m training.launch``, which reads the node index, node count and main-node address that Batch sets.

Resources come from the job's instance type (``operators.backends.resources``): every vCPU and GPU of the
node, its memory less the memory tax, the instance type named in the node properties. The container follows
AWS's multi-node reference (aws-samples/awsome-distributed-training, ``1.architectures/3.aws-batch``):
``/dev/shm`` (``sharedMemorySize``), ulimits ``memlock`` unlimited, ``stack`` 64 MiB, ``nofile`` 1024000, one
``/dev/infiniband/uverbsN`` device per EFA interface, and the libfabric / NCCL environment
(``FI_PROVIDER=efa``, ``FI_EFA_USE_DEVICE_RDMA=1`` where the type has GPUDirect RDMA, ``FI_EFA_FORK_SAFE=1``,
``NCCL_SOCKET_IFNAME``; ``NCCL_PROTO`` left to the aws-ofi-nccl plugin).

Fair share only where the queue has it: AWS rejects ``shareIdentifier`` / ``schedulingPriorityOverride`` on a
FIFO queue and requires a share on a fair-share one. A team's ``scheduling`` says which (``fair_share``,
``fifo``), or ``auto``: the queue's ``schedulingPolicyArn`` is read once with ``describe_job_queues``.

An array job (``JobSpec.array_size``, corpus-scoring shards) is one ``submit_job`` with ``arrayProperties.size``: each
child runs the same container with its index in ``AWS_BATCH_JOB_ARRAY_INDEX``; the parent ends once every child
has, FAILED if one failed, and :func:`classify_array_job` classes it from its failed children.

Host and Spot loss are retried by Batch itself (``retryStrategy.evaluateOnExit``); the job resumes from
its last checkpoint. Every other failure ends the job, and :func:`classify_job` turns the job and node
descriptions into a failure class.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from core.arrays import ARRAY_INDEX_VARIABLE
from core.config import BatchConfig, PlatformConfig, TeamConfig
from core.failures import ConfigError, ExitCode, FailureClass, Finding, classify_exit_code, decide
from operators.backends.base import JobSpec, JobState, JobStatus, launch_command, validate_for
from operators.backends.resources import Catalog, NodeResources, efa_environment, resolve

PENDING_STATES = ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING")
ACTIVE_STATES = (*PENDING_STATES, "RUNNING")
CANCEL_REASON = "Terminated by pinflow"
# Batch's statusReason when the instance under a node went away (Spot reclaim, host failure).
HOST_LOST = ("Host EC2", "Spot", "instance terminated", "CannotInspectContainerError", "DockerTimeoutError")
RETRY_ON_EXIT = [
    # Batch retries these itself (a new attempt resumes from the last checkpoint) ...
    {"onStatusReason": "Host EC2*", "action": "RETRY"},
    {"onReason": "CannotInspectContainerError:*", "action": "RETRY"},
    {"onReason": "DockerTimeoutError:*", "action": "RETRY"},
    # ... and leaves everything else to the task's retry policy, which knows the failure class.
    {"onReason": "*", "action": "EXIT"},
]
# AWS's reference: unlimited locked memory for NCCL's pinned buffers, 64 MiB stacks, many files and sockets.
ULIMITS = [
    {"name": "memlock", "softLimit": -1, "hardLimit": -1},
    {"name": "stack", "softLimit": 67108864, "hardLimit": 67108864},
    {"name": "nofile", "softLimit": 1024000, "hardLimit": 1024000},
]
# Reasons that say the container was stopped from outside: its SIGKILL (exit 137) is not an OOM.
KILLED_REASONS = (CANCEL_REASON, "timeout", "Task stopped", "terminated by user", "TerminateJob")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


class BatchBackend:
    name = "batch"

    @classmethod
    def from_config(cls, cfg: PlatformConfig, home: str | None = None) -> BatchBackend:
        return cls(cfg.batch, cfg.teams, Catalog.from_config(cfg))

    def __init__(
        self, options: BatchConfig | None = None, teams: Mapping[str, TeamConfig] | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self.options = options or BatchConfig()
        self.teams = dict(teams or {})
        self.catalog = catalog or Catalog.default()
        self._hook: Any = None
        self._logs_hook: Any = None
        self._fair_share: dict[str, bool] = {}

    # -- the request: pure ---------------------------------------------------------------------------------
    def job_queue(self, team: str) -> str:
        return self.teams[team].queue if team in self.teams else team

    def _container(self, spec: JobSpec, res: NodeResources) -> dict[str, Any]:
        opts = self.options
        resources = [
            {"type": "VCPU", "value": str(res.cpu_limit)},
            {"type": "MEMORY", "value": str(res.memory_limit_mib)},
        ]
        if res.gpus:
            resources.append({"type": "GPU", "value": str(res.gpus)})
        # An init process as PID 1 (docker --init): the agent gets the stop signal and orphans are reaped.
        linux: dict[str, Any] = {"initProcessEnabled": True, "sharedMemorySize": res.shm_mib}
        if res.efa:
            linux["devices"] = [
                {"hostPath": f"/dev/infiniband/uverbs{i}", "containerPath": f"/dev/infiniband/uverbs{i}",
                 "permissions": ["READ", "WRITE", "MKNOD"]}
                for i in range(res.efa)
            ]
        env = efa_environment(res, opts.nccl_socket_ifname) if spec.distributed else {}
        container: dict[str, Any] = {
            "image": res.image,
            "command": ["python", "-m", "training.launch", "--help"],  # overridden per job
            "resourceRequirements": resources,
            "linuxParameters": linux,
            "ulimits": ULIMITS,
            "logConfiguration": {"logDriver": "awslogs", "options": {"awslogs-group": opts.log_group}},
        }
        if env:
            container["environment"] = [{"name": k, "value": v} for k, v in sorted(env.items())]
        if spec.distributed:
            # Every node of a multi-node job on the same instance type (Batch requires it of node groups).
            container["instanceType"] = res.instance_type
        if opts.job_role_arn:
            container["jobRoleArn"] = opts.job_role_arn
        if opts.checkpoint_key_secret:  # the checkpoint signing key, from the secret store: never in the definition
            container["secrets"] = [{"name": "PINFLOW_CHECKPOINT_KEY", "valueFrom": opts.checkpoint_key_secret}]
        return container

    def job_definition(self, spec: JobSpec, res: NodeResources) -> dict[str, Any]:
        """The ``register_job_definition`` arguments; the name ends in a digest of the content."""
        container = self._container(spec, res)
        body: dict[str, Any] = {
            "platformCapabilities": ["EC2"],
            "retryStrategy": {"attempts": int(self.options.attempts), "evaluateOnExit": RETRY_ON_EXIT},
            "propagateTags": True,
        }
        if spec.distributed:
            body["type"] = "multinode"
            body["nodeProperties"] = {
                "numNodes": spec.nodes,
                "mainNode": 0,
                "nodeRangeProperties": [{"targetNodes": "0:", "container": container}],
            }
        else:
            body["type"] = "container"
            body["containerProperties"] = container
        return {"jobDefinitionName": f"pinflow-{spec.team}-{_digest(body)}", **body}

    def _environment(self, spec: JobSpec) -> list[dict[str, str]]:
        env = {"PYTHONUNBUFFERED": "1", **spec.env}
        if spec.distributed:
            env.setdefault("PINFLOW_RDZV_PORT", str(self.options.rdzv_port))
        if spec.checkpoint_dir:
            env.setdefault("PINFLOW_CHECKPOINT_DIR", spec.checkpoint_dir)
        if spec.array_size == 1:  # Batch has no array of one (2 to 10,000 children): a plain job, index 0
            env.setdefault(ARRAY_INDEX_VARIABLE, "0")
        return [{"name": k, "value": v} for k, v in sorted(env.items())]

    def configured_fair_share(self, team: str) -> bool | None:
        """The team's queue policy as configured: True fair share, False FIFO, None ``auto`` (ask AWS)."""
        return {"fair_share": True, "fifo": False}.get(self.teams[team].scheduling) if team in self.teams else None

    def dry_run(self, spec: JobSpec, *, fair_share: bool | None = None) -> dict[str, Any]:
        """``{"job_definition": register_job_definition kwargs, "submit": submit_job kwargs}``.

        ``fair_share`` says whether the team's queue has a scheduling policy (default: as configured; with
        ``scheduling: auto`` and no answer from AWS yet, the share fields are left out, as on a FIFO queue).
        """
        validate_for(spec, self.teams, backend=self.name)
        spec, res = resolve(spec, self.teams, self.catalog)
        definition = self.job_definition(spec, res)
        team = self.teams[spec.team]
        overrides = {"command": launch_command(spec), "environment": self._environment(spec)}
        submit: dict[str, Any] = {
            "jobName": spec.name,
            "jobQueue": self.job_queue(spec.team),
            "jobDefinition": definition["jobDefinitionName"],
        }
        if fair_share if fair_share is not None else self.configured_fair_share(spec.team):
            submit["shareIdentifier"] = team.share
            submit["schedulingPriorityOverride"] = team.priority
        submit.update({
            "timeout": {"attemptDurationSeconds": max(60, spec.timeout_s)},
            "tags": {"pinflow:team": spec.team, "pinflow:job": spec.name, "pinflow:instance-type": res.instance_type},
            "propagateTags": True,
        })
        if spec.distributed:
            submit["nodeOverrides"] = {
                "numNodes": spec.nodes,
                "nodePropertyOverrides": [{"targetNodes": "0:", "containerOverrides": overrides}],
            }
        else:
            submit["containerOverrides"] = overrides
        if spec.array_size > 1:
            submit["arrayProperties"] = {"size": spec.array_size}  # the child's index: AWS_BATCH_JOB_ARRAY_INDEX
        return {"job_definition": definition, "submit": submit}

    # -- the service ---------------------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        if self._hook is None:
            from airflow.providers.amazon.aws.hooks.batch_client import BatchClientHook

            self._hook = BatchClientHook(aws_conn_id=self.options.aws_conn_id, region_name=self.options.region_name)
        return self._hook

    @property
    def logs_hook(self) -> Any:
        if self._logs_hook is None:
            from airflow.providers.amazon.aws.hooks.logs import AwsLogsHook

            self._logs_hook = AwsLogsHook(aws_conn_id=self.options.aws_conn_id, region_name=self.options.region_name)
        return self._logs_hook

    def ping(self) -> None:
        """A cheap call that proves the credentials and the endpoint work."""
        self.hook.client.describe_job_queues(maxResults=1)

    def ensure_job_definition(self, definition: dict[str, Any]) -> str:
        """The ARN of the active definition with this content, registering it on first use."""
        client = self.hook.client
        name = definition["jobDefinitionName"]
        found = client.describe_job_definitions(jobDefinitionName=name, status="ACTIVE").get("jobDefinitions", [])
        if found:
            return str(max(found, key=lambda d: d["revision"])["jobDefinitionArn"])
        return str(client.register_job_definition(**definition)["jobDefinitionArn"])

    def find(self, job_name: str, team: str | None = None) -> str | None:
        """The id of an active job named ``job_name`` in the team's queue (or any team's queue)."""
        queues = [self.job_queue(team)] if team else sorted({self.job_queue(t) for t in self.teams})
        client = self.hook.client
        for queue in queues:
            pages = client.get_paginator("list_jobs").paginate(
                jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [job_name]}]
            )
            jobs = [j for page in pages for j in page.get("jobSummaryList", []) if j.get("jobName") == job_name]
            # A name that also has ended jobs (a Batch retry keeps the id) : the newest one wins.
            if jobs:
                return str(max(jobs, key=lambda j: j.get("createdAt", 0))["jobId"])
        return None

    def fair_share(self, team: str) -> bool:
        """Whether the team's queue has a fair-share scheduling policy: configured, or asked of AWS once."""
        configured = self.configured_fair_share(team)
        if configured is not None:
            return configured
        queue = self.job_queue(team)
        if queue not in self._fair_share:
            found = self.hook.client.describe_job_queues(jobQueues=[queue]).get("jobQueues", [])
            if not found:
                raise ConfigError(
                    f"AWS Batch job queue {queue!r} does not exist in {self.options.region_name} "
                    f"(teams.{team}.queue in config/platform.yaml)"
                )
            self._fair_share[queue] = bool(found[0].get("schedulingPolicyArn"))
        return self._fair_share[queue]

    def submit(self, spec: JobSpec) -> str:
        request = self.dry_run(spec, fair_share=self.fair_share(spec.team))
        existing = self.find(spec.name, spec.team)
        if existing:
            return existing
        arn = self.ensure_job_definition(request["job_definition"])
        response = self.hook.client.submit_job(**{**request["submit"], "jobDefinition": arn})
        return str(response["jobId"])

    def describe(self, job_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The job's description and, for a failed multi-node job, its nodes' descriptions."""
        job = self.hook.get_job_description(job_id)
        nodes: list[dict[str, Any]] = []
        if job.get("status") == "FAILED" and job.get("nodeProperties"):
            count = int(job["nodeProperties"].get("numNodes", 0))
            ids = [f"{job_id}#{i}" for i in range(count)]
            if ids:
                nodes = self.hook.client.describe_jobs(jobs=ids).get("jobs", [])
        return job, nodes

    def array_children(self, job_id: str, status: str = "FAILED") -> list[dict[str, Any]]:
        """Descriptions of an array job's children in ``status`` (``list_jobs`` by ``arrayJobId``, then
        ``describe_jobs`` 100 at a time)."""
        client = self.hook.client
        pages = client.get_paginator("list_jobs").paginate(arrayJobId=job_id, jobStatus=status)
        ids = [j["jobId"] for page in pages for j in page.get("jobSummaryList", [])]
        return [job for i in range(0, len(ids), 100) for job in client.describe_jobs(jobs=ids[i:i + 100]).get("jobs", [])]

    def status(self, job_id: str) -> JobStatus:
        job, nodes = self.describe(job_id)
        if is_array_parent(job):
            return classify_array_job(job, self.array_children(job_id) if job.get("status") == "FAILED" else [])
        return classify_job(job, nodes)

    def logs(self, job_id: str, tail: int = 50) -> str:
        parts = []
        for info in self.hook.get_job_all_awslogs_info(job_id):
            events = list(self.logs_hook.get_log_events(info["awslogs_group"], info["awslogs_stream_name"]))
            lines = [e["message"] for e in events][-tail:]
            parts.append(f"--- {info['awslogs_stream_name']} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def cancel(self, job_id: str) -> None:
        self.hook.terminate_job(job_id, CANCEL_REASON)

    def console_url(self, job_id: str) -> str:
        region = self.options.region_name or "us-east-1"
        return f"https://{region}.console.aws.amazon.com/batch/home?region={region}#jobs/detail/{job_id}"


def _seconds(ms: Any) -> float | None:
    return float(ms) / 1000 if ms else None


def classify_job(job: dict[str, Any], nodes: list[dict[str, Any]] | None = None) -> JobStatus:
    """A ``describe_jobs`` entry (and its nodes' entries, ``<id>#<n>``) as a :class:`JobStatus`.

    Pure, so recorded responses of outcomes a test cannot produce (Spot reclaim, a failed node) can be
    fed to it. A lost host is INFRA whatever the exit codes; otherwise a node whose exit code names a class
    beats nodes that only saw their peer go away (INFRA). OOM where Batch says so (``OutOfMemoryError``), or
    exit 137 the job chose itself; a 137 after a terminate or a timeout is the SIGKILL that stopped it: INFRA.
    The times are Batch's own (``createdAt``, ``startedAt``, ``stoppedAt``).
    """
    job_id = str(job.get("jobId", "?"))
    state = str(job.get("status", ""))
    created, started = _seconds(job.get("createdAt")), _seconds(job.get("startedAt"))
    if state in PENDING_STATES:
        return JobStatus(job_id, JobState.PENDING, reason=state, created_at=created)
    if state == "RUNNING":
        return JobStatus(job_id, JobState.RUNNING, created_at=created, started_at=started)
    ended = _seconds(job.get("stoppedAt"))
    if state == "SUCCEEDED":
        return JobStatus(job_id, JobState.SUCCEEDED, created_at=created, started_at=started, ended_at=ended)
    if state != "FAILED":
        raise ValueError(f"AWS Batch job ({job_id}) has an unknown status {state!r}")

    reason = str(job.get("statusReason", ""))
    entries = [(f"node {n.get('nodeDetails', {}).get('nodeIndex', i)}", n) for i, n in enumerate(nodes or [])]
    if not entries:
        entries = [("job", job)]
    codes: dict[str, int | None] = {}
    found: list[Finding] = []
    for label, entry in entries:
        container = entry.get("container") or {}
        attempts = entry.get("attempts") or []
        last = (attempts[-1].get("container") or {}) if attempts else {}
        code = container.get("exitCode", last.get("exitCode"))
        codes[label] = code
        why = " ".join(str(x) for x in (entry.get("statusReason"), container.get("reason"), last.get("reason")) if x)
        if any(marker.lower() in why.lower() for marker in HOST_LOST):
            found.append(Finding(FailureClass.INFRA, f"{label}: {why} (host lost)", node_lost=True))
        elif "OutOfMemory" in why:
            found.append(Finding(FailureClass.OOM, f"{label}: {why}"))
        elif code == ExitCode.OOM and any(k.lower() in f"{why} {reason}".lower() for k in KILLED_REASONS):
            found.append(Finding(FailureClass.INFRA, f"{label} was killed (exit 137, SIGKILL) when stopped: "
                                                     f"{why or reason}"))
        elif code not in (None, 0):
            klass = classify_exit_code(int(code)) or FailureClass.USER
            found.append(Finding(klass, f"{label} exited with code {code}" + (f": {why}" if why else "")))
        elif entry.get("status") == "FAILED" and why:
            infra = CANCEL_REASON in why or "timeout" in why.lower()
            found.append(Finding(FailureClass.INFRA if infra else FailureClass.USER, f"{label}: {why}"))
    decided = decide(found)
    if decided is not None:
        klass, message = decided.failure_class, decided.message
    elif any(marker.lower() in reason.lower() for marker in HOST_LOST) or "timeout" in reason.lower():
        klass, message = FailureClass.INFRA, reason
    else:
        klass, message = FailureClass.USER, reason or "failed without a reason"
    detail = f"AWS Batch job ({job_id}) failed: {message}"
    if reason and reason not in message:
        detail += f" [{reason}]"
    return JobStatus(job_id, JobState.FAILED, klass, detail, codes, created_at=created, started_at=started, ended_at=ended)


def is_array_parent(job: dict[str, Any]) -> bool:
    """An array job's parent: ``arrayProperties`` with a size (a child's have an ``index`` instead)."""
    props = job.get("arrayProperties") or {}
    return "size" in props and "index" not in props


def classify_array_job(job: dict[str, Any], failed_children: list[dict[str, Any]] | None = None) -> JobStatus:
    """An array job's parent (and its failed children's descriptions) as a :class:`JobStatus`; pure.

    The parent stays PENDING while its children run: it is RUNNING once a child runs or has ended
    (``arrayProperties.statusSummary``). A failed parent takes the class of its failed children by the one
    precedence rule (a lost host, then a class a child chose itself, then INFRA), each child classed by
    :func:`classify_job`; the reason says how many children failed, and which.
    """
    job_id = str(job.get("jobId", "?"))
    state = str(job.get("status", ""))
    created, started = _seconds(job.get("createdAt")), _seconds(job.get("startedAt"))
    props = job.get("arrayProperties") or {}
    summary = {k: int(v) for k, v in (props.get("statusSummary") or {}).items()}
    size = int(props.get("size", 0))
    if state in PENDING_STATES or state == "RUNNING":
        begun = summary.get("RUNNING", 0) + summary.get("SUCCEEDED", 0) + summary.get("FAILED", 0)
        if state == "RUNNING" or begun:
            return JobStatus(job_id, JobState.RUNNING, reason=f"children {summary}" if summary else "",
                             created_at=created, started_at=started)
        return JobStatus(job_id, JobState.PENDING, reason=state, created_at=created)
    if state != "FAILED":
        return classify_job(job)
    codes: dict[str, int | None] = {}
    found: list[Finding] = []
    indexes = []
    for child in failed_children or []:
        index = (child.get("arrayProperties") or {}).get("index", "?")
        indexes.append(index)
        child_status = classify_job(child)
        codes[f"child-{index}"] = next(iter(child_status.exit_codes.values()), None)
        node_lost = any(marker.lower() in child_status.reason.lower() for marker in HOST_LOST)
        found.append(Finding(child_status.failure_class or FailureClass.USER,
                             f"array child {index}: {child_status.reason}", node_lost=node_lost))
    decided = decide(found)
    if decided is None:
        klass, message = FailureClass.INFRA, str(job.get("statusReason") or "failed, no failed child found")
    else:
        klass, message = decided.failure_class, decided.message
    count = summary.get("FAILED", len(found))
    detail = (f"AWS Batch array job ({job_id}) failed: {count} of {size} children failed "
              f"({sorted(indexes, key=str)[:20]}); {message}")
    return JobStatus(job_id, JobState.FAILED, klass, detail, codes, created_at=created, started_at=started,
                     ended_at=_seconds(job.get("stoppedAt")))
