"""The failure model (docs/architecture.md §4): classes, exit codes, typed errors, and the one place an error's class is decided.

Every entry point in ``training/`` and ``features/`` exits with the code of its class, so every backend (a
local process, an AWS Batch node, a Kubernetes pod) classifies the outcome the same way; the Airflow layer
raises the same typed errors, which the tasks' retry policy retries (``INFRA``) or fails at once.

- :func:`classify` decides the class of an exception (typed errors carry theirs; torch, botocore, MLflow and
  OS errors are recognised without importing those libraries);
- :func:`classify_exit_code` decides the class of a process exit code;
- :func:`decide` picks the class of a job from what each of its nodes reported (the precedence rule).
"""

from __future__ import annotations

import enum
import errno
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass


class FailureClass(enum.StrEnum):
    """Why a job ended badly, and so what a retry can do about it."""

    INFRA = "INFRA"  # node lost, spot reclaimed, preflight failed, collective timeout, stall: retry + resume
    USER = "USER"  # exception in model code, NaN loss, bad config or credentials: fail now
    DATA = "DATA"  # validation failed, missing partition: fail now, nothing downstream runs
    OOM = "OOM"  # out of memory (the kernel or the device said so): fail with advice

    @property
    def retryable(self) -> bool:
        return self is FailureClass.INFRA


class ExitCode(enum.IntEnum):
    """Documented process exit codes of ``training`` and ``features`` entry points."""

    OK = 0
    USER = 1  # an uncaught exception is a bug in the model code or its config
    DATA = 65  # sysexits EX_DATAERR
    INFRA = 75  # sysexits EX_TEMPFAIL: try again
    NAN_LOSS = 76
    OOM = 137  # the kernel's OOM killer (SIGKILL) or torch.OutOfMemoryError


_EXIT_CLASS = {
    ExitCode.USER: FailureClass.USER,
    ExitCode.DATA: FailureClass.DATA,
    ExitCode.INFRA: FailureClass.INFRA,
    ExitCode.NAN_LOSS: FailureClass.USER,
    ExitCode.OOM: FailureClass.OOM,
}
_CLASS_EXIT = {
    FailureClass.USER: ExitCode.USER,
    FailureClass.DATA: ExitCode.DATA,
    FailureClass.INFRA: ExitCode.INFRA,
    FailureClass.OOM: ExitCode.OOM,
}

ADVICE = {
    FailureClass.INFRA: "retried (a training job resumes from its last checkpoint, a feature build or scoring job does "
                        "only what is missing)",
    FailureClass.USER: "fix the model code, the run's params or the platform config, then clear the task",
    FailureClass.DATA: "fix or rebuild the input partitions, then clear the task",
    FailureClass.OOM: "lower batch_size or give each node more memory",
}


def classify_exit_code(code: int) -> FailureClass | None:
    """The failure class of a process exit code; ``None`` for success.

    A negative code is a signal (Python's subprocess convention): the process was killed from outside
    (node lost): INFRA. 137 (the shell form of SIGKILL) is OOM, the kernel's OOM killer's signature.
    """
    if code == 0:
        return None
    if code < 0:
        return FailureClass.INFRA
    try:
        return _EXIT_CLASS[ExitCode(code)]
    except (ValueError, KeyError):
        return FailureClass.INFRA if code > 128 else FailureClass.USER


def exit_code_of(failure_class: FailureClass) -> ExitCode:
    return _CLASS_EXIT[failure_class]


# --- typed errors ---------------------------------------------------------------------------------------


class PinflowError(Exception):
    """An error that knows its failure class; entry points exit with its code, tasks retry or fail by it."""

    failure_class: FailureClass = FailureClass.USER
    exit_code: ExitCode = ExitCode.USER


class UserError(PinflowError):
    """A bug in model code, a bad config, a setting to change: retrying cannot help."""


class ConfigError(UserError, ValueError):
    """A configuration (platform.yaml, RUN.json, a form value, a job spec) is invalid; the message names the key."""


class DataError(PinflowError):
    """Validation failed or a partition is missing: nothing downstream may run."""

    failure_class = FailureClass.DATA
    exit_code = ExitCode.DATA


class InfraError(PinflowError):
    """Lost node, preflight failure, stall, a service that does not answer: retried, resuming."""

    failure_class = FailureClass.INFRA
    exit_code = ExitCode.INFRA


class TaskGoneError(InfraError):
    """The job's lease expired (``core.lease``): no task watches it any more, so it does not register its model.
    INFRA: a retry of the task submits a job that resumes from the last checkpoint."""


class OOMError(PinflowError):
    failure_class = FailureClass.OOM
    exit_code = ExitCode.OOM


class NanLossError(UserError):
    exit_code = ExitCode.NAN_LOSS


ERROR_FOR_CLASS: dict[FailureClass, type[PinflowError]] = {
    FailureClass.INFRA: InfraError,
    FailureClass.USER: UserError,
    FailureClass.DATA: DataError,
    FailureClass.OOM: OOMError,
}


# --- classifying an exception ---------------------------------------------------------------------------

# Messages of RuntimeErrors raised by a collective or the rendezvous store when a peer is gone or slow.
_INFRA_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "rendezvous",
    "process group",
    "processgroup",
)
# An MLflow tracking server or registry that does not answer is infrastructure, not a bug.
_MLFLOW_INFRA_MARKERS = (
    "max retries exceeded", "api request to", "connection refused", "temporarily unavailable",
    "database is locked", "unable to open database", "connection", "timed out",
)
_MLFLOW_UNAVAILABLE_CODES = ("TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED")
# S3 error codes that a later try can get past (besides any 5xx reply).
_AWS_RETRY_CODES = (
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "TooManyRequestsException", "ServiceUnavailable", "InternalError",
)
# Replies that say the request will never succeed as configured: a setting to change.
_AWS_USER_CODES = (
    "AccessDenied", "AccessDeniedException", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "UnrecognizedClientException", "InvalidClientTokenId", "NoSuchBucket", "AuthorizationError",
)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a disk or a disk quota is full (OSError's errno; DuckDB and others only say it in words)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    message = str(exc).lower()
    return "no space left on device" in message or "disk quota exceeded" in message


def classify(exc: BaseException) -> FailureClass:
    """The failure class of an exception; the one place an error's class is decided.

    Typed errors carry their class; out of memory (torch or Python) → OOM; errors of the process group or
    rendezvous, connection errors and time-outs, a full disk, an MLflow server or an AWS API that does not answer or
    replies 5xx / throttling → INFRA; missing or refused AWS credentials, a bucket that does not exist → USER;
    anything else → USER. Causes (``raise ... from``) are followed when the error itself says nothing.
    """
    seen: BaseException | None = exc
    while seen is not None:
        found = _classify_one(seen)
        if found is not None:
            return found
        seen = seen.__cause__  # explicit chaining only: an error raised while handling another is its own
    return FailureClass.USER


def _classify_one(exc: BaseException) -> FailureClass | None:
    if isinstance(exc, PinflowError):
        return exc.failure_class
    if isinstance(exc, MemoryError):
        return FailureClass.OOM
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return FailureClass.OOM
        if isinstance(exc, torch.distributed.DistError):  # DistBackendError, DistNetworkError, DistStoreError
            return FailureClass.INFRA
    aws = _classify_aws(exc)
    if aws is not None:
        return aws
    message = str(exc).lower()
    if type(exc).__name__ in ("MlflowException", "RestException"):
        code = str(getattr(exc, "error_code", ""))
        if code in _MLFLOW_UNAVAILABLE_CODES or any(m in message for m in _MLFLOW_INFRA_MARKERS):
            return FailureClass.INFRA
        return None
    if type(exc).__module__.startswith(("sqlalchemy", "requests", "urllib3")) and (
        "operationalerror" in type(exc).__name__.lower() or "connection" in type(exc).__name__.lower()
        or "timeout" in type(exc).__name__.lower()
    ):
        return FailureClass.INFRA  # a tracking database or HTTP service that does not answer
    if isinstance(exc, ConnectionError | TimeoutError):
        return FailureClass.INFRA
    if disk_full(exc):
        return FailureClass.INFRA  # once space is freed the same work succeeds: the retries' backoff gives time
    if isinstance(exc, RuntimeError) and "out of memory" in message:
        return FailureClass.OOM
    if isinstance(exc, RuntimeError) and any(marker in message for marker in _INFRA_MARKERS):
        return FailureClass.INFRA
    return None


def _classify_aws(exc: BaseException) -> FailureClass | None:
    """botocore's errors (S3 through s3fs, Batch, Logs), if botocore is loaded at all."""
    if "botocore" not in sys.modules:
        return None
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        NoCredentialsError,
        NoRegionError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, NoCredentialsError | PartialCredentialsError | NoRegionError):
        return FailureClass.USER
    # EndpointConnectionError, ConnectTimeoutError; ReadTimeoutError, ConnectionClosedError
    if isinstance(exc, BotoConnectionError | HTTPClientError):
        return FailureClass.INFRA
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code"))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _AWS_USER_CODES:
            return FailureClass.USER
        if status >= 500 or code in _AWS_RETRY_CODES:
            return FailureClass.INFRA
        return FailureClass.USER
    return None


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code of an exception: a typed error's own code, else its class's."""
    if isinstance(exc, PinflowError):
        return exc.exit_code
    return exit_code_of(classify(exc))


def as_typed(exc: BaseException, what: str) -> PinflowError:
    """``exc`` as the typed error of its class, its message prefixed by ``what`` failed (raise it ``from exc``)."""
    if isinstance(exc, PinflowError):
        return exc
    klass = classify(exc)
    return ERROR_FOR_CLASS[klass](f"{what}: {type(exc).__name__}: {exc} ({klass.value}: {ADVICE[klass]})")


# --- a job's class from its nodes --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """What one node (process, Batch node, pod) of a job reported when the job failed."""

    failure_class: FailureClass
    message: str
    node_lost: bool = False  # the platform saw the node go (host terminated, Spot, eviction, killed from outside)


def decide(findings: Iterable[Finding]) -> Finding | None:
    """The job's failure from its nodes' findings: the one precedence rule.

    1. A node the platform saw go wins: the others failed because their peer vanished (INFRA, retried).
    2. Otherwise a class a node chose itself (USER, DATA, OOM) beats a peer's INFRA, which only says that
       its neighbour stopped answering (a NaN on rank 1 makes rank 0's all-reduce time out).
    3. Otherwise INFRA. ``None`` when there is nothing to decide from.
    """
    findings = list(findings)
    for finding in findings:
        if finding.node_lost:
            return finding
    for finding in findings:
        if finding.failure_class is not FailureClass.INFRA:
            return finding
    return findings[0] if findings else None


def signal_name(code: int) -> str:
    """``SIGKILL`` for -9 or 137; '' when the code is not a signal."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return signal.Signals(number).name if number else ""
    except ValueError:
        return ""
