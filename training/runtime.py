"""What every ``training`` entry point shares: the process's place in the job, heartbeats, exit codes.

- :class:`DistEnv` reads the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``); without them the process is rank 0 of a world of one.
- :class:`Heartbeat` writes ``heartbeat-rank{r}.json`` atomically every few seconds, for the operator's
  progress log and stall detection (``output_dir`` is a local folder or a URL: ``core.storage``).
- :func:`write_failure` leaves ``failure-rank{r}.json`` with the class and the reason, because an exit code
  crossing ``torchrun`` or a container runtime says *what class*, not *why* (the class of an exception and
  its exit code are decided by ``core.failures``).
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

from core import storage
from core.failures import ExitCode, FailureClass, PinflowError, classify_exit_code

log = logging.getLogger("training")

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
            raise PinflowError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {e}") from None

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
        self.path = storage.join(output_dir, f"heartbeat-rank{env.rank}.json")
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
            storage.write_json(self.path, payload)
        # A full or flaky disk, or an object store not answering (its client's own errors are not all
        # OSErrors), must not kill training: the stall detector will notice.
        except Exception as e:  # noqa: BLE001
            log.warning("could not write heartbeat %s: %s", self.path, e)
        self._last, self._since, self._examples = now, now, 0


def failure_path(output_dir: str | os.PathLike[str], rank: int) -> str:
    return storage.join(output_dir, f"failure-rank{rank}.json")


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
        storage.write_json(failure_path(output_dir, rank), payload)
    except Exception as e:  # noqa: BLE001 - the exit code still says the class; this file only says why
        log.warning("could not write the failure file for rank %d: %s", rank, e)
