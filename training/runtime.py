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

from core import claims, storage
from core.failures import ExitCode, FailureClass, InfraError, PinflowError, classify_exit_code

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


def peak_rss_bytes() -> int:
    """This process's peak resident set so far: ``VmHWM`` (Linux; this program's own, since its exec), else
    ``ru_maxrss`` (which may count the memory of the process it was forked from)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class Heartbeat:
    """``<output_dir>/heartbeat-rank{r}.json``, rewritten atomically at most every ``every_s`` seconds.

    Fields: rank, world_size, phase (starting | training | checkpointing | evaluating | logging | done |
    failed), step, epoch, loss (absent before the first step), examples_per_s (since the previous beat),
    progress (a counter that grows with any work: training steps, evaluation batches), time (ISO),
    unix_time, host, pid, peak_rss_bytes (the process's peak resident set so far); once training: total_steps, epochs, percent, steps_per_s and eta_s (from the steps
    of this try so far), input_wait_share (of this try's step time, waiting for the next batch) and
    data_bound_share (the threshold of the data-bound verdict), and on rank 0 loss_history, ``[step, loss]`` pairs thinned to at most
    ``LOSS_POINTS`` (the training page's loss curve).
    """

    LOSS_POINTS = 200

    def __init__(self, output_dir: str | os.PathLike[str], env: DistEnv, every_s: float = 10.0) -> None:
        self.path = storage.join(output_dir, f"heartbeat-rank{env.rank}.json")
        self.env = env
        self.every_s = every_s
        self.fields: dict[str, Any] = {"phase": "starting", "step": 0, "epoch": 0, "examples_per_s": 0.0}
        self.progress = 0
        self._last = 0.0
        self._examples = 0
        self._since = time.monotonic()
        self._rate_from: tuple[float, int] | None = None  # (monotonic time, step) when steps were first seen
        self._loss_history: list[list[float]] = []
        self._loss_stride = 1

    def update(self, examples: int = 0, progress: int = 1, force: bool = False, **fields: Any) -> None:
        """Record progress and new field values; write the file if ``every_s`` has passed (or ``force``)."""
        self.fields.update(fields)
        self._examples += examples
        self.progress += progress
        self._record_loss()
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self.write(now)

    def write(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._since, 1e-9)
        if self._examples:
            self.fields["examples_per_s"] = self._examples / elapsed
        self._progress(now)
        payload = {
            **self.fields,
            **({"loss_history": self._loss_history} if self.env.rank == 0 and self._loss_history else {}),
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "progress": self.progress,
            "time": now_iso(),
            "unix_time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        try:
            storage.write_json(self.path, payload)
        # A full or flaky disk, or an object store not answering (its client's own errors are not all
        # OSErrors), must not kill training: the stall detector will notice.
        except Exception as e:  # noqa: BLE001
            log.warning("could not write heartbeat %s: %s", self.path, e)
        self._last, self._since, self._examples = now, now, 0

    def _progress(self, now: float) -> None:
        """Percent, rate and ETA of the training steps (the rate over this try's steps so far)."""
        step, total = self.fields.get("step"), self.fields.get("total_steps")
        if not isinstance(step, int) or not total or self.fields.get("phase") != "training":
            return
        self.fields["percent"] = round(100.0 * min(step, total) / total, 2)
        if self._rate_from is None:
            self._rate_from = (now, step)
        elif step > self._rate_from[1] and now > self._rate_from[0]:
            rate = (step - self._rate_from[1]) / (now - self._rate_from[0])
            self.fields["steps_per_s"] = rate
            self.fields["eta_s"] = max(0.0, (total - step) / rate)

    def _record_loss(self) -> None:
        """Rank 0: the step's loss as a point of the curve (thinned: at most ``LOSS_POINTS``, evenly spaced)."""
        step, loss = self.fields.get("step"), self.fields.get("loss")
        if self.env.rank != 0 or not isinstance(step, int) or step <= 0 or not isinstance(loss, float) or loss != loss:
            return
        if self._loss_history and step < self._loss_history[-1][0] + self._loss_stride:
            return
        self._loss_history.append([step, round(loss, 6)])
        if len(self._loss_history) > self.LOSS_POINTS:  # thin out: every other point, and half as often from now
            self._loss_history = self._loss_history[::2]
            self._loss_stride *= 2

    def progress_line(self) -> str:
        """This rank's progress, for the job's own log (examples/s for all ranks, assuming they keep pace)."""
        beat = {**self.fields, "world_size": self.env.world_size}
        return progress_line([beat], ranks=self.env.world_size)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_line(beats: list[dict[str, Any]], ranks: int | None = None) -> str:
    """One line of a job's progress from its ranks' heartbeats: ``step 120/480 (25.0%), epoch 1/3, loss 0.6931,
    2,345 examples/s, ETA 3m12s (2 ranks reporting)``. No loss is shown before the first step.

    ``ranks``: scale one beat's examples/s to that many ranks (the job's own log, where a rank sees only itself).
    """
    if not beats:
        return "no heartbeat yet"
    lead = min(beats, key=lambda b: int(b.get("rank", 0)))
    step, total = lead.get("step", 0), lead.get("total_steps")
    phase = lead.get("phase", "starting")
    parts = [f"step {step}/{total}" + (f" ({100.0 * min(int(step), int(total)) / int(total):.1f}%)" if total else "")
             if total else f"step {step}"]
    if lead.get("epochs"):
        parts.append(f"epoch {int(lead.get('epoch', 0)) + 1}/{lead['epochs']}")
    if phase != "training":
        parts.append(str(phase))
    loss = lead.get("loss")
    if isinstance(loss, (int, float)) and int(step or 0) > 0 and loss == loss:  # not before the first step; not NaN
        parts.append(f"loss {float(loss):.4f}")
    rate = sum(float(b.get("examples_per_s") or 0.0) for b in beats)
    if ranks:
        rate = float(lead.get("examples_per_s") or 0.0) * ranks
    if rate:
        parts.append(f"{rate:,.0f} examples/s")
    if lead.get("eta_s") is not None and phase == "training":
        parts.append(f"ETA {_duration(float(lead['eta_s']))}")
    shares = [float(b["input_wait_share"]) for b in beats if b.get("input_wait_share") is not None]
    if shares:  # the rank that waits most: one slow reader holds every rank at the next collective
        threshold = float(lead.get("data_bound_share") or 1.0)
        parts.append(f"input wait {max(shares):.0%}" + (" (data-bound)" if max(shares) >= threshold else ""))
    line = ", ".join(parts)
    return line if ranks else f"{line} ({len(beats)} rank(s) reporting)"


class InputClock:
    """How long a rank waits for its next batch (``wait_s``) against how long it computes its steps
    (``compute_s``): the share of step time spent waiting says whether the job is data-bound."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.compute_s = 0.0

    def add(self, wait_s: float, compute_s: float) -> None:
        self.wait_s += wait_s
        self.compute_s += compute_s

    @property
    def share(self) -> float | None:
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else None


def cpus_per_process() -> int:
    """The CPUs this process may use, shared by the node's training processes (torchrun's LOCAL_WORLD_SIZE)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def input_verdict(wait_s: float, compute_s: float, worst_share: float | None, *, threshold: float, engine: str,
                  num_workers: int, cpus: int) -> dict[str, Any]:
    """The job's data-bound verdict: the share of step time its ranks waited for input (all ranks together; the
    worst rank's too) and, at or above ``threshold``, what to change. ``cpus``: CPUs per training process."""
    total = wait_s + compute_s
    share = wait_s / total if total > 0 else None
    data_bound = share is not None and max(share, worst_share or 0.0) >= threshold
    shown = max(share or 0.0, worst_share or 0.0)
    if not data_bound:
        advice = None
    elif engine == "ray":
        advice = (f"data-bound: {shown:.0%} of step time waiting for input; give the Ray cluster more CPU workers "
                  "(a larger RayCluster on EKS, training.ray_cpus on a node-local one)")
    elif cpus - 1 > num_workers:
        advice = (f"data-bound: {shown:.0%} of step time waiting for input; raise num_workers to "
                  f"{min(cpus - 1, max(num_workers + 1, 2 * num_workers))} (the node has {cpus} CPUs per training "
                  "process) or use input_engine ray")
    else:
        advice = (f"data-bound: {shown:.0%} of step time waiting for input, and the node has no CPU to spare for more "
                  f"input workers ({cpus} per training process, num_workers {num_workers}): use input_engine ray "
                  "(CPU workers on other nodes) or fewer processes per node")
    return {"engine": engine, "num_workers": num_workers, "wait_s": round(wait_s, 3), "compute_s": round(compute_s, 3),
            "wait_share": None if share is None else round(share, 4),
            "worst_rank_wait_share": None if worst_share is None else round(worst_share, 4),
            "threshold": threshold, "data_bound": data_bound, "advice": advice}


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


RUN_LOCK = ".pinflow-training.lock"  # in a run's local checkpoint_dir and output_dir: core.claims


def hold_run_folders(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> list[int]:
    """A job's claims on its local ``checkpoint_dir`` and ``output_dir`` for as long as this process lives
    (``core.claims.hold``: the kernel drops them when the process ends, however it ends; forked input workers do not
    inherit them); the descriptors. Held by the node-0 agent of ``training.launch`` before any worker starts, or by
    a training process started on its own.

    A second job given one of the folders (two jobs started by hand with one RUN.json) would resume from, and prune,
    the first's checkpoints, or overwrite its heartbeats and result: it stops at once with an InfraError naming the
    first. A folder that cannot hold a claim is not claimed (an object store: there the operators' one-job-per-run
    rule is the guard; a file system without locks, a read-only folder: a warning).
    """
    harm = {"checkpoint_dir": "resume from and delete each other's checkpoints",
            "output_dir": "overwrite each other's heartbeats, failure files and result"}
    held: list[int] = []
    seen: set[str] = set()
    try:
        for name, folder in (("checkpoint_dir", checkpoint_dir), ("output_dir", output_dir)):
            if storage.is_remote(folder):
                continue
            path = os.path.realpath(os.path.join(storage.local_path(folder), RUN_LOCK))
            if path in seen:
                continue
            seen.add(path)
            try:
                fd = claims.hold(path)
            except claims.Claimed as other:
                raise InfraError(
                    f"{name} {folder} is in use by another training job ({other.holder}): two jobs in one folder "
                    f"would {harm[name]}. Wait for that job to end (this one then resumes from its last checkpoint), "
                    f"or give this run its own {name} in RUN.json"
                ) from None
            if fd is not None:
                held.append(fd)
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    return held
