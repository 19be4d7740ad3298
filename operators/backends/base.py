"""The backend-agnostic job description and the interface every compute backend implements."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.failures import ConfigError, FailureClass

if TYPE_CHECKING:
    from core.config import PlatformConfig, TeamConfig

MAX_ARRAY_SIZE = 10000  # AWS Batch's limit on an array job's children

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# A container image reference: [registry[:port]/]path[:tag][@sha256:digest].
_IMAGE_RE = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)


@dataclass(frozen=True)
class JobSpec:
    """What to run, where and with what resources; the same for every backend.

    Resources per node come from the instance type (``operators.backends.resources``): left empty, the job gets
    the type's image and the whole node; set, ``cpus_per_node`` / ``memory_gb_per_node`` / ``gpus_per_node`` ask
    for part of it. ``command`` is the container's argument list after the interpreter, e.g.
    ``["-m", "training.train", "--config", "/jobs/x/RUN.json"]``. With ``distributed`` the backend starts it
    under ``torchrun`` with ``nodes`` × ``procs_per_node`` processes; otherwise it runs once.
    """

    name: str
    command: list[str]
    team: str
    # Empty or None: from the instance type (``operators.backends.resources``): its image, the whole node.
    image: str = ""
    distributed: bool = False
    nodes: int = 1
    procs_per_node: int = 1
    instance_type: str = ""  # a key of instance_types:; empty: the team's, else training.instance_type
    cpus_per_node: int | None = None
    memory_gb_per_node: float | None = None
    gpus_per_node: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: int = 6 * 3600
    checkpoint_dir: str | None = None
    # Distributed jobs: run ``training.preflight`` in the same world first (``training.launch --preflight``).
    preflight: bool = False
    # An array job: ``array_size`` independent runs of ``command`` (one node each), each told its index in
    # [0, array_size) by its backend's variable (``core.arrays.ARRAY_INDEX_VARIABLES``). A failed child does not stop the others;
    # the job has failed once every child has ended and one of them failed. 0: not an array.
    array_size: int = 0
    # Children running at once: the local backend's processes, a Kubernetes Indexed Job's ``parallelism``
    # (AWS Batch runs as many as its compute environment fits). 0: local, the machine's CPUs; kubernetes, all.
    array_parallelism: int = 0
    # ``ray``: ``command`` is a Ray driver. On kubernetes a KubeRay ``RayJob`` (a head and ``ray_workers`` worker
    # pods of the instance type, the driver submitted to it); elsewhere one process that starts a Ray cluster on
    # its own node.
    engine: Literal["process", "ray"] = "process"
    ray_workers: int = 0

    def validate(self) -> None:
        """Fail before anything is submitted, saying which setting to change."""
        problems = []
        if not _NAME_RE.match(self.name):
            problems.append(f"name {self.name!r} must be 1-63 chars of a-z, 0-9 and '-'")
        if not self.command:
            problems.append("command is empty")
        if self.nodes < 1:
            problems.append(f"nodes={self.nodes}: need at least 1 (training.nodes)")
        if self.procs_per_node < 1:
            problems.append(f"procs_per_node={self.procs_per_node}: need at least 1 (training.procs_per_node)")
        if not self.distributed and self.nodes * self.procs_per_node != 1:
            problems.append("a job that is not distributed runs exactly one process: set distributed=True")
        for key in ("cpus_per_node", "memory_gb_per_node", "gpus_per_node"):
            value = getattr(self, key)
            if value is not None and value < 0:
                problems.append(f"{key}={value} is negative")
        if self.gpus_per_node and self.procs_per_node > self.gpus_per_node:
            problems.append(
                f"procs_per_node={self.procs_per_node} > gpus_per_node={self.gpus_per_node}: run one process per GPU "
                "(training.procs_per_node)"
            )
        if self.image and not _IMAGE_RE.match(self.image):
            problems.append(f"image {self.image!r} is not a container image reference (training.image)")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s={self.timeout_s} must be positive")
        if not 0 <= self.array_size <= MAX_ARRAY_SIZE:
            problems.append(f"array_size={self.array_size} must be in [0, {MAX_ARRAY_SIZE}] (inference.max_shards)")
        if self.array_size and (self.distributed or self.engine == "ray"):
            problems.append("an array job runs single processes: not distributed, not a Ray job")
        if self.array_parallelism < 0 or self.ray_workers < 0:
            problems.append("array_parallelism and ray_workers must not be negative")
        if problems:
            raise ConfigError(f"job spec {self.name!r} is invalid: " + "; ".join(problems))


def launch_command(spec: JobSpec, *, python: str = "python", rendezvous: Sequence[str] = ()) -> list[str]:
    """The command every node of a job runs, the same on every backend.

    A distributed job runs ``python -m training.launch`` (torchrun with the job's rendezvous, optionally the
    nodes' preflight in the same world, exit codes per failure class) around ``spec.command``; ``rendezvous``
    adds what the backend sets by flag rather than by environment (the local backend's agents on localhost).
    """
    if not spec.distributed:
        return [python, *spec.command]
    return [
        python, "-m", "training.launch", f"--nproc-per-node={spec.procs_per_node}", *rendezvous,
        f"--rdzv-id={spec.name}", *(["--preflight"] if spec.preflight else []), "--", *spec.command,
    ]


def validate_for(spec: JobSpec, teams: Mapping[str, TeamConfig], *, backend: str = "") -> None:
    """``spec.validate()`` plus the checks against platform config: the team exists. (What fits on a node is
    checked against its instance type when a backend resolves the spec: ``operators.backends.resources``.)"""
    spec.validate()
    if spec.team not in teams:
        raise ConfigError(
            f"job spec {spec.name!r} cannot run on {backend or 'this backend'}: team {spec.team!r} is not under "
            f"teams: in config/platform.yaml (known: {', '.join(sorted(teams))}); set the operator's team or add "
            "the team there"
        )


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


@dataclass(frozen=True)
class JobStatus:
    """A job's state as its backend reports it, with the times the backend knows (epoch seconds)."""

    job_id: str
    state: JobState
    failure_class: FailureClass | None = None
    reason: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    created_at: float | None = None  # the backend accepted the job
    started_at: float | None = None  # it began to run (None while queued, or when the backend does not say)
    ended_at: float | None = None

    @property
    def queued_s(self) -> float | None:
        """Seconds between submission and start (queue wait, instance boot, image pull); None if unknown."""
        if self.created_at is None or self.started_at is None:
            return None
        return max(0.0, self.started_at - self.created_at)


class Backend(Protocol):
    """A compute backend (an extension point, ``core.registry``). A job's array children learn their index from
    ``PINFLOW_ARRAY_INDEX``, or from the backend's own variable listed in ``core.arrays.ARRAY_INDEX_VARIABLES``."""

    name: str

    @classmethod
    def from_config(cls, cfg: PlatformConfig, home: str | None = None) -> Backend:
        """The backend set up from the platform configuration (``home``: where a local backend keeps its jobs)."""

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """The native request for ``spec``; pure, so a test can assert the whole thing."""

    def find(self, job_name: str) -> str | None:
        """The id of an existing job with this name, so a retried task never submits a duplicate."""

    def submit(self, spec: JobSpec) -> str:
        """Submit (or find the job already submitted under ``spec.name``) and return its id."""

    def status(self, job_id: str) -> JobStatus: ...

    def logs(self, job_id: str, tail: int = 50) -> str: ...

    def cancel(self, job_id: str) -> None: ...

    def ping(self) -> None:
        """A cheap call that raises if the backend does not answer (preflight)."""

    def console_url(self, job_id: str) -> str:
        """Where a person looks at the job: the AWS console, the Kubernetes dashboard, the job folder."""
