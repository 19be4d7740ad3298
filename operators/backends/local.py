"""The embedded default backend: the job's processes run on this machine.

A distributed job starts one ``training.launch`` agent per node, the agents meeting through a c10d
rendezvous on localhost (several agents stand for several nodes) at a port found free at submit; a job on one
node uses torchrun's ``--standalone`` (the OS picks the port), so no job depends on a fixed port. Every job has a folder
``<home>/jobs/<name>/`` holding its request, each node's pid, log and exit code, so a restarted Airflow
worker finds the job again and never starts it twice.

An array job (``JobSpec.array_size``) runs its children as parallel local processes, at most
``array_parallelism`` at a time (default: the machine's CPUs), under an array runner (``local_array.py``, in a
session of its own); each child is told its index by ``PINFLOW_ARRAY_INDEX`` and has its own log and end files,
and a failed child does not stop the others (as in an AWS Batch array job or a Kubernetes Indexed Job).

Each node runs under a supervisor (``local_node.py``, in a session of its own) that records the node's end:
its exit code, or the signal that killed it, and whether the kernel's OOM killer killed a process meanwhile.
A node killed by a signal is INFRA (retried, resuming) unless the kernel says OOM; an exit code names its
class (``core.failures``). The agent's workers die with the agent (``training.launch``), so nothing of a
killed or cancelled job keeps running.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import storage
from core.arrays import ARRAY_INDEX_VARIABLE
from core.failures import FailureClass, Finding, classify_exit_code, decide, signal_name
from operators.backends.base import JobSpec, JobState, JobStatus, launch_command

if TYPE_CHECKING:
    from core.config import PlatformConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# The node supervisor: runs the command, records how it ended even if the worker that started it is gone.
NODE_SUPERVISOR = Path(__file__).with_name("local_node.py")
# The array runner: starts an array job's children (each under the node supervisor), a few at a time.
ARRAY_RUNNER = Path(__file__).with_name("local_array.py")
RENDEZVOUS_PORT_AT_SUBMIT = "<a free port, chosen at submit>"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for a job's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


CHECKPOINT_KEY_VARIABLE = "PINFLOW_CHECKPOINT_KEY"  # training.checkpoint.KEY_ENV (not imported: it imports torch)


class LocalBackend:
    name = "local"

    @classmethod
    def from_config(cls, cfg: PlatformConfig, home: str | None = None) -> LocalBackend:
        return cls(home or cfg.home)

    def __init__(self, home: str | os.PathLike[str]) -> None:
        self.jobs_dir = Path(home) / "jobs"
        self.secrets_dir = Path(home) / "secrets"

    def checkpoint_key(self) -> str:
        """The checkpoint signing key of this home's jobs (``training.checkpoint``): the environment's, else one made
        once under ``<home>/secrets/`` (mode 0600), apart from the storage root the jobs write their checkpoints to.
        Given to each job's environment, never written into its request."""
        if os.environ.get(CHECKPOINT_KEY_VARIABLE):
            return os.environ[CHECKPOINT_KEY_VARIABLE]
        path = self.secrets_dir / "checkpoint.key"
        if not path.exists():
            self.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path.with_suffix(f".{os.getpid()}.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
            try:  # the first of two racing writers wins; the other's key is dropped
                os.link(path.with_suffix(f".{os.getpid()}.tmp"), path)
            except FileExistsError:
                pass
            os.unlink(path.with_suffix(f".{os.getpid()}.tmp"))
        return path.read_text().strip()

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def dry_run(self, spec: JobSpec, *, rendezvous_port: int | None = None) -> dict[str, Any]:
        """The request ``submit`` starts. A job on several nodes meets at ``127.0.0.1:<rendezvous_port>``, a port
        that ``submit`` finds free (shown as ``RENDEZVOUS_PORT_AT_SUBMIT`` here); one node needs none (torchrun's
        ``--standalone`` lets the OS pick the port)."""
        spec.validate()  # the team is checked by the operator; the local machine serves every team
        job_dir = self.job_dir(spec.name)
        if spec.distributed and spec.nodes > 1:
            port = RENDEZVOUS_PORT_AT_SUBMIT if rendezvous_port is None else str(rendezvous_port)
            nodes = [
                launch_command(spec, python=sys.executable, rendezvous=(
                    f"--nnodes={spec.nodes}", f"--node-rank={rank}", f"--rdzv-endpoint=127.0.0.1:{port}",
                ))
                for rank in range(spec.nodes)
            ]
        elif spec.distributed:
            nodes = [launch_command(spec, python=sys.executable, rendezvous=("--nnodes=1", "--node-rank=0"))]
        else:
            nodes = [launch_command(spec, python=sys.executable)] * max(1, spec.array_size)
        request: dict[str, Any] = {
            "job_name": spec.name,
            "job_dir": str(job_dir),
            "team": spec.team,
            "timeout_s": spec.timeout_s,
            # The clone first, then the caller's path (where a team's model family module may live).
            "env": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1", **spec.env},
            "nodes": [
                {"argv": argv, "log": str(job_dir / f"node-{rank}.log"), "exit_file": str(job_dir / f"node-{rank}.exit"),
                 "end_file": str(job_dir / f"node-{rank}.end.json")}
                for rank, argv in enumerate(nodes)
            ],
        }
        if spec.array_size:
            for index, node in enumerate(request["nodes"]):
                node["env"] = {ARRAY_INDEX_VARIABLE: str(index)}
            request["array"] = {"size": spec.array_size,
                                "parallelism": min(spec.array_size, spec.array_parallelism or os.cpu_count() or 1)}
        return request

    def find(self, job_name: str) -> str | None:
        return job_name if (self.job_dir(job_name) / "request.json").exists() else None

    def submit(self, spec: JobSpec) -> str:
        existing = self.find(spec.name)
        if existing:
            return existing
        request = self.dry_run(spec, rendezvous_port=free_port() if spec.distributed and spec.nodes > 1 else None)
        job_dir = self.job_dir(spec.name)
        job_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **request["env"], CHECKPOINT_KEY_VARIABLE: self.checkpoint_key()}
        request["submitted_at"] = time.time()
        pids = []
        if "array" in request:
            # One runner starts the children (each under its node supervisor) as earlier ones end.
            array_file = job_dir / "array.json"
            storage.write_json(str(array_file), {**request, "supervisor": str(NODE_SUPERVISOR),
                                                 "python": sys.executable, "cwd": str(REPO_ROOT)})
            with open(job_dir / "runner.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-P", str(ARRAY_RUNNER), str(array_file)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, cwd=REPO_ROOT, start_new_session=True,
                )
            request["pids"] = [proc.pid]
            storage.write_json(str(job_dir / "request.json"), request)
            return spec.name
        for node in request["nodes"]:
            with open(node["log"], "ab") as log:
                # -P: the supervisor's folder (operators/backends) must not shadow modules on sys.path.
                proc = subprocess.Popen(
                    [sys.executable, "-P", str(NODE_SUPERVISOR), node["exit_file"], node["end_file"], "--", *node["argv"]],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, cwd=REPO_ROOT, start_new_session=True,
                )
            pids.append(proc.pid)
        request["pids"] = pids
        # Written last: a job folder without request.json was never started.
        storage.write_json(str(job_dir / "request.json"), request)
        return spec.name

    def _request(self, job_id: str) -> dict[str, Any]:
        path = self.job_dir(job_id) / "request.json"
        if not path.exists():
            raise LookupError(f"local job {job_id!r} not found: no {path}")
        return json.loads(path.read_text())

    def status(self, job_id: str) -> JobStatus:
        request = self._request(job_id)
        if "array" in request:
            return self._array_status(job_id, request)
        decided_file = self.job_dir(job_id) / "failed.json"
        codes: dict[str, int | None] = {}
        ends: dict[str, dict[str, Any]] = {}
        lost = []
        for rank, (node, pid) in enumerate(zip(request["nodes"], request["pids"], strict=True)):
            exit_file = Path(node["exit_file"])
            _reap(pid)
            gone = not _alive(pid)  # before looking for the exit file, which a supervisor writes just before it ends
            if exit_file.exists():
                codes[f"node-{rank}"] = int(exit_file.read_text().strip() or 1)
                end_file = Path(node.get("end_file", ""))
                if node.get("end_file") and end_file.exists():
                    ends[f"node-{rank}"] = json.loads(end_file.read_text())
            else:
                codes[f"node-{rank}"] = None
                if gone:
                    lost.append(rank)
        times = {"created_at": request.get("submitted_at"), "started_at": request.get("submitted_at")}
        if decided_file.exists():  # decided once, and its other nodes stopped: the same answer ever after
            failed = json.loads(decided_file.read_text())
            return JobStatus(job_id, JobState.FAILED, FailureClass(failed["failure_class"]), failed["reason"], codes,
                             **times, ended_at=failed["decided_at"])
        findings = [
            # Its supervisor is gone too: the whole node was taken away (a lost host), which wins over what the
            # other nodes then report about their vanished peer.
            *(Finding(FailureClass.INFRA, f"node(s) {lost} disappeared without an exit code (process killed or host "
                                          "lost)", node_lost=True) for _ in lost[:1]),
            *(node_finding(node, code, ends.get(node, {})) for node, code in codes.items() if code not in (None, 0)),
        ]
        decided = decide(findings)
        ended = max((e["ended_at"] for e in ends.values() if "ended_at" in e), default=None)
        if decided is not None:
            # As a Batch multi-node job or a JobSet ends with its first failed node, stop the others (they would
            # wait for their vanished peer until a timeout) so that a retry never runs beside them; the decision
            # is kept, so that their ends do not change it.
            survivors = [pid for node, pid in zip(codes, request["pids"], strict=True) if codes[node] is None]
            storage.write_json(str(decided_file), {"failure_class": decided.failure_class.value,
                                                   "reason": decided.message, "decided_at": time.time()})
            self._stop(request, survivors, signal.SIGKILL)
            return JobStatus(job_id, JobState.FAILED, decided.failure_class, decided.message, codes, **times, ended_at=ended)
        if all(code == 0 for code in codes.values()):
            return JobStatus(job_id, JobState.SUCCEEDED, None, "", codes, **times, ended_at=ended)
        return JobStatus(job_id, JobState.RUNNING, None, "", codes, **times)

    def _array_status(self, job_id: str, request: dict[str, Any]) -> JobStatus:
        """An array job: RUNNING while a child has not ended; then SUCCEEDED, or FAILED with the class of its
        failed children (a child killed by a signal, or never run because its runner vanished: INFRA)."""
        runner = request["pids"][0]
        _reap(runner)
        gone = not _alive(runner)  # before the exit files: the runner ends only after its children
        codes: dict[str, int | None] = {}
        ends: dict[str, dict[str, Any]] = {}
        lost = []
        for index, node in enumerate(request["nodes"]):
            name = f"child-{index}"
            exit_file = Path(node["exit_file"])
            if exit_file.exists():
                codes[name] = int(exit_file.read_text().strip() or 1)
                end_file = Path(node["end_file"])
                if end_file.exists():
                    ends[name] = json.loads(end_file.read_text())
            else:
                codes[name] = None
                if gone:
                    lost.append(index)
        times = {"created_at": request.get("submitted_at"), "started_at": request.get("submitted_at")}
        if any(code is None for code in codes.values()) and not gone:
            return JobStatus(job_id, JobState.RUNNING, None, "", codes, **times)
        findings = [
            *(Finding(FailureClass.INFRA, f"array children {lost} never ended (the array runner was killed)",
                      node_lost=True) for _ in lost[:1]),
            *(node_finding(name, code, ends.get(name, {})) for name, code in codes.items() if code not in (None, 0)),
        ]
        ended = max((e["ended_at"] for e in ends.values() if "ended_at" in e), default=None)
        decided = decide(findings)
        if decided is None:
            return JobStatus(job_id, JobState.SUCCEEDED, None, "", codes, **times, ended_at=ended)
        failed = sorted(int(name.split("-")[1]) for name, code in codes.items() if code != 0)
        reason = (f"{decided.message} ({len(failed)} of {len(codes)} array children failed: {failed[:20]}; "
                  "the others succeeded)")
        return JobStatus(job_id, JobState.FAILED, decided.failure_class, reason, codes, **times, ended_at=ended)

    def logs(self, job_id: str, tail: int = 50) -> str:
        request = self._request(job_id)
        if "array" in request:  # the children that failed (or have not ended), else the first: not all of a big array
            children = list(enumerate(request["nodes"]))
            nodes = [(index, node) for index, node in children
                     if not Path(node["exit_file"]).exists()
                     or Path(node["exit_file"]).read_text().strip() not in ("0",)][:5] or children[:5]
            return "\n".join(
                f"--- array child {index} ({node['log']}) ---\n"
                + "\n".join(Path(node["log"]).read_text(errors="replace").splitlines()[-tail:]
                             if Path(node["log"]).exists() else [])
                for index, node in nodes
            )
        parts = []
        for rank, node in enumerate(request["nodes"]):
            path = Path(node["log"])
            lines = path.read_text(errors="replace").splitlines()[-tail:] if path.exists() else []
            parts.append(f"--- node {rank} ({path}) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def ping(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)

    def console_url(self, job_id: str) -> str:
        return self.job_dir(job_id).as_uri()

    @staticmethod
    def _stop(request: dict[str, Any], pids: list[int], sig: int) -> None:
        """Signal the process groups (supervisor and agent) of these nodes; their workers die with the agents."""
        _stop_groups([pid for pid in pids if pid in request["pids"]], sig)

    def cancel(self, job_id: str, grace_seconds: float = 20.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``grace_seconds``) and return once they are gone,
        so a retry never finds the cancelled job still running.

        Each node's process group holds its supervisor and its agent; the agent's workers (torchrun gives
        them sessions of their own) stop with the agent."""
        request = self._request(job_id)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._stop(request, request["pids"], sig)
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline:
                for pid in request["pids"]:
                    _reap(pid)
                if not any(_alive(pid) for pid in request["pids"]):
                    return
                time.sleep(0.1)


def _stop_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def node_finding(node: str, code: int, end: dict[str, Any]) -> Finding:
    """What a node's end says: a signal is INFRA (killed from outside) unless the kernel OOM-killed meanwhile."""
    if code < 0:
        name = signal_name(code) or f"signal {-code}"
        if end.get("oom_kill") and code == -signal.SIGKILL:
            return Finding(FailureClass.OOM, f"{node} was killed by {name} from the kernel's OOM killer "
                                             "(memory.events oom_kill rose)")
        return Finding(FailureClass.INFRA, f"{node} was killed by {name} (killed from outside or host lost; "
                                           "the kernel recorded no OOM kill)", node_lost=True)
    return Finding(classify_exit_code(code) or FailureClass.USER, f"{node} exited with code {code}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    """Collect our own finished child, so it does not linger as a zombie that looks alive."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
