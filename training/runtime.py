"""What every ``training`` entry point shares: the process's place in the job, heartbeats, exit codes.

- :class:`DistEnv` reads the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``); without them the process is rank 0 of a world of one.
- :class:`Heartbeat` writes ``heartbeat-rank{r}.json`` atomically every few seconds, for the operator's
  progress log and stall detection (``output_dir`` is a local folder or a URL: ``training.storage_io``).
- :func:`exit_code_for` maps an exception to the documented exit code of its failure class
  (``training.failures``); :func:`write_failure` leaves ``failure-rank{r}.json`` with the reason, because
  an exit code crossing ``torchrun`` or a container runtime says *what class*, not *why*.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from training import storage_io
from training.failures import ExitCode, FailureClass, TrainingError, classify_exit_code

log = logging.getLogger("training")

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
# An MLflow tracking server that does not answer is infrastructure, not a bug.
_MLFLOW_INFRA_MARKERS = ("max retries exceeded", "api request to", "connection refused")
# S3 error codes that a later try can get past (besides any 5xx reply).
_S3_RETRY_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # True under torchrun (or any launcher that sets the variables)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return cls()
        try:
            return cls(
                rank=int(env.get("RANK", "0")),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                launched=True,
            )
        except ValueError as e:
            raise TrainingError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {e}") from None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


class Heartbeat:
    """``<output_dir>/heartbeat-rank{r}.json``, rewritten atomically at most every ``every_s`` seconds.

    Fields: rank, world_size, phase (starting | training | checkpointing | evaluating | logging | done |
    failed), step, epoch, loss (absent before the first step), examples_per_s (since the previous beat),
    progress (a counter that grows with any work: training steps, evaluation batches), time (ISO),
    unix_time, host, pid.
    """

    def __init__(self, output_dir: str | os.PathLike[str], env: DistEnv, every_s: float = 10.0) -> None:
        self.path = storage_io.join(output_dir, f"heartbeat-rank{env.rank}.json")
        self.env = env
        self.every_s = every_s
        self.fields: dict[str, Any] = {"phase": "starting", "step": 0, "epoch": 0, "examples_per_s": 0.0}
        self.progress = 0
        self._last = 0.0
        self._examples = 0
        self._since = time.monotonic()

    def update(self, examples: int = 0, progress: int = 1, force: bool = False, **fields: Any) -> None:
        """Record progress and new field values; write the file if ``every_s`` has passed (or ``force``)."""
        self.fields.update(fields)
        self._examples += examples
        self.progress += progress
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self.write(now)

    def write(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._since, 1e-9)
        if self._examples:
            self.fields["examples_per_s"] = self._examples / elapsed
        payload = {
            **self.fields,
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "progress": self.progress,
            "time": now_iso(),
            "unix_time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        try:
            storage_io.write_json(self.path, payload)
        # A full or flaky disk, or an object store not answering (its client's own errors are not all
        # OSErrors), must not kill training: the stall detector will notice.
        except Exception as e:  # noqa: BLE001
            log.warning("could not write heartbeat %s: %s", self.path, e)
        self._last, self._since, self._examples = now, now, 0


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code of an exception (training.failures):

    TrainingError subclasses → their own code; torch.OutOfMemoryError / MemoryError → OOM; errors of the
    process group or rendezvous (gloo/NCCL timeouts, a lost peer), connection errors, an unreachable
    MLflow server and an object store that does not answer or replies 5xx / throttling → INFRA; anything
    else → USER.
    """
    import torch

    if isinstance(exc, TrainingError):
        return exc.exit_code
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return ExitCode.OOM
    if isinstance(exc, torch.distributed.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return ExitCode.INFRA
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ExitCode.INFRA
    message = str(exc).lower()
    if isinstance(exc, RuntimeError) and "out of memory" in message:
        return ExitCode.OOM
    if isinstance(exc, RuntimeError) and any(marker in message for marker in _INFRA_MARKERS):
        return ExitCode.INFRA
    if type(exc).__name__ == "MlflowException" and any(m in message for m in _MLFLOW_INFRA_MARKERS):
        return ExitCode.INFRA
    if object_store_unavailable(exc):
        return ExitCode.INFRA
    return ExitCode.USER


def object_store_unavailable(exc: BaseException) -> bool:
    """A botocore error (S3 through s3fs) that a retry can get past: no connection, a timeout, a 5xx or
    throttling reply. s3fs re-raises a reply as an OSError whose cause is the botocore error."""
    if "botocore" not in sys.modules:  # nothing spoke to S3 in this process
        return False
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    seen: BaseException | None = exc
    while seen is not None:
        # EndpointConnectionError, ConnectTimeoutError; ReadTimeoutError, ConnectionClosedError
        if isinstance(seen, BotoConnectionError | HTTPClientError):
            return True
        if isinstance(seen, ClientError):
            status = int(seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return status >= 500 or seen.response.get("Error", {}).get("Code") in _S3_RETRY_CODES
        seen = seen.__cause__
    return False


def failure_path(output_dir: str | os.PathLike[str], rank: int) -> str:
    return storage_io.join(output_dir, f"failure-rank{rank}.json")


def write_failure(output_dir: str | os.PathLike[str], rank: int, exc: BaseException, code: ExitCode) -> None:
    """``failure-rank{r}.json``: exit code, failure class, exception type, message and traceback."""
    klass = classify_exit_code(int(code)) or FailureClass.USER
    payload = {
        "rank": rank,
        "exit_code": int(code),
        "exit_name": code.name,
        "failure_class": klass.value,
        "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
        "time": now_iso(),
        "host": socket.gethostname(),
    }
    try:
        storage_io.write_json(failure_path(output_dir, rank), payload)
    except Exception as e:  # noqa: BLE001 - the exit code still says the class; this file only says why
        log.warning("could not write the failure file for rank %d: %s", rank, e)
